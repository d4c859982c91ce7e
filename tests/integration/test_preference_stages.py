"""Reward model, DPO and LoRA merge end to end: real DeepSpeed ranks, real checkpoints, real peft."""

import json
from pathlib import Path

import pytest
import torch

from checkpoints import CheckpointError, read_manifest, verify
from datasets_prep.preference import collate_pairs, prepare_pairs
from stages.dpo import DPOConfig, pair_logps, run_dpo
from stages.lora_merge import LoraMergeConfig, run_lora_merge
from stages.reward_model import RewardModelConfig, pair_rewards, run_reward_model
from stages.sft import SFTConfig, run_sft
from tests.conftest import metrics

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

TRAIN = {"dtype": "fp32", "train_batch_size": 8, "micro_train_batch_size": 4, "warmup_ratio": 0.0, "progress_bar": False}


def _pairs_data(task_files, split="preference"):
    return {"paths": [str(task_files[split])], "max_len": 64}


def test_reward_model_zero3_two_ranks_learns_and_loads_in_auto_class(task_files, micro_sft, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    cfg = RewardModelConfig.model_validate({
        "data": {**_pairs_data(task_files), "packing": True},
        "eval_data": _pairs_data(task_files, "preference_eval"),
        "train": {**TRAIN, "world_size": 2, "zero_stage": 3, "micro_train_batch_size": 2, "max_steps": 16, "lr": 3e-3},
        "eval_steps": 8,
        "output_root": str(tmp_path),
    })
    ref = run_reward_model(cfg, micro_sft)
    verify(ref)
    m = read_manifest(ref.path)
    assert (m.kind, m.stage, m.parent) == ("reward", "reward_model", micro_sft.digest)
    steps = metrics(ref)
    assert sum(s["loss"] for s in steps[-4:]) / 4 < sum(s["loss"] for s in steps[:4]) / 4
    assert [s["step"] for s in steps if "eval_accuracy" in s] == [8, 16]
    stats = m.extra["reward_stats"]
    assert stats["reward_std"] > 0
    # loads with the standard class and no newly initialised weight
    logging.set_verbosity_warning()
    model, info = AutoModelForSequenceClassification.from_pretrained(
        ref.path, num_labels=1, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert model.config.reward_mean == pytest.approx(stats["reward_mean"])
    # and scores like the trained model did at the end (its eval accuracy is reproduced exactly)
    pairs, _ = prepare_pairs(cfg.eval_data, tokenizer)
    batch = collate_pairs(pairs, tokenizer.pad_token_id)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model.eval(), batch)
        hf = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    assert torch.allclose(torch.cat([chosen, rejected]), hf, atol=1e-5)
    assert (chosen > rejected).float().mean().item() == pytest.approx(stats["eval_accuracy"])
    allr = torch.cat([chosen, rejected])
    assert allr.mean().item() == pytest.approx(stats["reward_mean"], abs=1e-5)
    base = AutoModelForSequenceClassification.from_pretrained(micro_sft.path, num_labels=1, dtype=torch.float32)
    assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)
    _serve_rm_scores_like_the_stage(ref, pairs, tokenizer, chosen, rejected, stats)


def _serve_rm_scores_like_the_stage(ref, pairs, tokenizer, chosen, rejected, stats):
    """`python -m stages.serve_rm` (uvicorn on 127.0.0.1, a bearer token) scores the eval pairs' texts in
    OpenRLHF's protocol: the stage's normalised scores, so the same pairs come out ahead."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RM_TOKEN": "rm-secret"}
    proc = subprocess.Popen([sys.executable, "-m", "stages.serve_rm", ref.path, "--port", str(port), "--token-env", "RM_TOKEN"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer rm-secret"}

    def call(path, body=None, headers=auth):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    try:
        deadline = time.time() + 120
        while True:
            try:
                health = call("/health")
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "no answer"
                time.sleep(0.5)
        assert health["status"] == "ok" and health["normalized"] is True and health["digest"] == ref.digest
        with pytest.raises(urllib.error.HTTPError, match="401"):
            call("/health", headers={})
        texts = [tokenizer.decode(p.prompt_ids + p.chosen_ids) for p in pairs]
        texts += [tokenizer.decode(p.prompt_ids + p.rejected_ids) for p in pairs]
        out = call("/get_reward", {"query": texts, "prompts": [""] * len(texts), "labels": [None] * len(texts)})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    served = torch.tensor(out["rewards"])
    n = len(pairs)
    want = (torch.cat([chosen, rejected]) - stats["reward_mean"]) / stats["reward_std"]
    assert torch.allclose(served, want, atol=1e-4)
    assert torch.equal(served[:n] > served[n:], chosen > rejected)


def test_dpo_zero3_two_ranks_learns_and_both_reference_modes_agree(task_files, micro_sft, micro_model, tmp_path):
    from transformers import AutoModelForCausalLM

    def cfg(precompute: bool, root: str, **train):
        return DPOConfig.model_validate({
            "data": {**_pairs_data(task_files), "packing": True},
            "beta": 0.5,
            "precompute_ref_logps": precompute,
            "eval_data": {**_pairs_data(task_files, "preference_eval"), "max_samples": 12},
            "eval_steps": 5,
            "train": {**TRAIN, "world_size": 2, "zero_stage": 3, "micro_train_batch_size": 2, "max_steps": 10, "lr": 3e-3, **train},
            "output_root": str(tmp_path / root),
        })

    live = run_dpo(cfg(False, "live"), micro_sft)
    pre = run_dpo(cfg(True, "pre"), micro_sft)
    first_live, first_pre = metrics(live)[0], metrics(pre)[0]
    # at the first step the policy is the reference: every pair's loss is log 2
    assert first_live["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert first_pre["loss"] == pytest.approx(first_live["loss"], abs=1e-5)
    steps = metrics(live)
    assert steps[-1]["reward_margin"] > 0 and steps[-1]["loss"] < steps[0]["loss"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, metrics(pre))) < 1e-4
    # held-out pairs at steps 5 and 10: loss, reward accuracy and margins; both reference modes agree, and the
    # policy has moved past log 2 on pairs it never trained on
    evals = [s for s in steps if "eval_loss" in s]
    assert [s["step"] for s in evals] == [5, 10]
    for a, b in zip(evals, [s for s in metrics(pre) if "eval_loss" in s]):
        for key in ("eval_loss", "eval_reward_accuracy", "eval_reward_margin", "eval_chosen_reward", "eval_rejected_reward"):
            assert abs(a[key] - b[key]) < 1e-4, key
    assert evals[-1]["eval_reward_margin"] == pytest.approx(evals[-1]["eval_chosen_reward"] - evals[-1]["eval_rejected_reward"], abs=1e-6)
    assert abs(evals[-1]["eval_loss"] - 0.6931471805599453) > 1e-3 and 0.0 <= evals[-1]["eval_reward_accuracy"] <= 1.0
    m = read_manifest(live.path)
    assert (m.kind, m.stage, m.parent) == ("full", "dpo", micro_sft.digest)
    new = AutoModelForCausalLM.from_pretrained(live.path, dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(micro_sft.path, dtype=torch.float32)
    assert not torch.equal(new.lm_head.weight, old.lm_head.weight)
    # an explicit reference (the untrained base): both modes again give the same first-step loss,
    # which is the loss computed here from transformers log-probs
    ref_live = run_dpo(cfg(False, "ref_live", world_size=1, zero_stage=2, micro_train_batch_size=4, max_steps=1), micro_sft, micro_model)
    ref_pre = run_dpo(cfg(True, "ref_pre", world_size=1, zero_stage=2, micro_train_batch_size=4, max_steps=1), micro_sft, micro_model)
    a, b = metrics(ref_live)[0]["loss"], metrics(ref_pre)[0]["loss"]
    assert abs(a - b) < 1e-5 and abs(a - 0.6931471805599453) > 1e-3


def test_wrong_kinds_are_refused_before_training(task_files, micro_sft, tmp_path):
    rm_cfg = RewardModelConfig.model_validate({
        "data": _pairs_data(task_files), "train": {**TRAIN, "max_steps": 1}, "output_root": str(tmp_path),
    })
    rm = run_reward_model(rm_cfg, micro_sft)
    dpo_cfg = DPOConfig.model_validate({"data": _pairs_data(task_files), "train": TRAIN, "output_root": str(tmp_path)})
    with pytest.raises(CheckpointError, match=r"a 'reward' checkpoint \(from stage 'reward_model'\) was given as the DPO policy"):
        run_dpo(dpo_cfg, rm)
    with pytest.raises(CheckpointError, match=r"was given as the SFT base model"):
        run_sft(SFTConfig.model_validate({"data": {"paths": [str(task_files["sft"])]}, "output_root": str(tmp_path)}), rm)
    with pytest.raises(ValueError, match=r"label_smoothing: 0.1 is only used by loss 'cdpo'"):
        DPOConfig.model_validate({"data": _pairs_data(task_files), "label_smoothing": 0.1})


@pytest.mark.parametrize("stage", ["sft", "reward_model", "dpo"])
def test_lora_adapter_merges_to_the_same_outputs(stage, task_files, micro_sft, micro_model, tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    lora = {"rank": 4, "alpha": 8}
    train = {**TRAIN, "max_steps": 3, "lr": 1e-2}
    if stage == "sft":
        base = micro_model
        adapter = run_sft(SFTConfig.model_validate({
            "data": {"paths": [str(task_files["sft"])], "input_key": "messages", "output_key": None, "max_len": 64},
            "train": train, "lora": lora, "output_root": str(tmp_path)}), base)
    elif stage == "reward_model":
        base = micro_sft
        adapter = run_reward_model(RewardModelConfig.model_validate({
            "data": _pairs_data(task_files), "eval_data": _pairs_data(task_files, "preference_eval"),
            "train": train, "lora": lora, "output_root": str(tmp_path)}), base)
    else:
        base = micro_sft
        adapter = run_dpo(DPOConfig.model_validate({
            "data": _pairs_data(task_files), "precompute_ref_logps": True,
            "train": train, "lora": lora, "output_root": str(tmp_path)}), base)
    am = read_manifest(adapter.path)
    assert (am.kind, am.base) == ("adapter", base.digest)
    merged = run_lora_merge(LoraMergeConfig(output_root=str(tmp_path)), adapter, base)
    mm = read_manifest(merged.path)
    assert mm.kind == ("reward" if stage == "reward_model" else "full") and mm.parent == adapter.digest
    pairs, _ = prepare_pairs(DPOConfig.model_validate({"data": _pairs_data(task_files, "preference_eval")}).data, tokenizer)
    batch = collate_pairs(pairs[:8], tokenizer.pad_token_id)
    with torch.no_grad():
        if stage == "reward_model":
            ref_model = PeftModel.from_pretrained(
                AutoModelForSequenceClassification.from_pretrained(base.path, num_labels=1, dtype=torch.float32), adapter.path
            ).eval()
            out = AutoModelForSequenceClassification.from_pretrained(merged.path, num_labels=1, dtype=torch.float32).eval()
            expected, got = torch.cat(pair_rewards(ref_model, batch)), torch.cat(pair_rewards(out, batch))
            assert out.config.reward_std == pytest.approx(am.extra["reward_stats"]["reward_std"])
        else:
            ref_model = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32), adapter.path
            ).eval()
            out = AutoModelForCausalLM.from_pretrained(merged.path, dtype=torch.float32).eval()
            expected = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            got = out(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            assert torch.allclose(torch.cat(pair_logps(ref_model, batch)[:2]), torch.cat(pair_logps(out, batch)[:2]), atol=1e-4)
    assert (expected - got).abs().max().item() < 1e-5
    other = micro_model if base is micro_sft else micro_sft
    with pytest.raises(CheckpointError, match="adapter was trained on base .* merge it onto the base it names"):
        run_lora_merge(LoraMergeConfig(output_root=str(tmp_path)), adapter, other)
