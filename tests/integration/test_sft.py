"""The SFT stage end to end: real DeepSpeed ranks (gloo on CPU), real checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import CheckpointError, load_ref, read_manifest, verify
from datasets_prep.loading import DataConfig, DataError
from datasets_prep.sft import prepare_sft
from stages.common.config import LoggingConfig
from stages.common.launcher import StageFailed
from stages.common.recipe import RecipeError, load_config
from stages.sft import SFTConfig, run_sft
from tests.conftest import no_worker_processes, wandb_history

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _config(task_files, out, **train) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "data": {"paths": [str(task_files["sft"])], "input_key": "messages", "output_key": None,
                     "max_len": 64, "packing": True},
            "train": {"world_size": 1, "zero_stage": 2, "dtype": "fp32", "train_batch_size": 8,
                      "micro_train_batch_size": 4, "max_steps": 6, "lr": 3e-3, "warmup_ratio": 0.0,
                      "progress_bar": False, **train},
            "output_root": str(out),
        }
    )


def _losses(ref) -> list[float]:
    run_dir = Path(ref.path).parent
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank_run(task_files, micro_model, tmp_path_factory):
    """The reference: 6 steps on one rank, 2 accumulation steps of 4 packed rows, in-stage saves."""
    return run_sft(_config(task_files, tmp_path_factory.mktemp("one"), save_steps=2), micro_model)


def test_two_ranks_zero3_learns_and_exports_the_engine_weights(task_files, micro_model, one_rank_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _config(task_files, tmp_path, world_size=2, zero_stage=3, micro_train_batch_size=2)
    cfg = cfg.model_copy(update={"eval_steps": 3, "eval_data": DataConfig(
        paths=[str(task_files["eval"])], input_key="prompt", output_key="answer", max_len=64, max_samples=12),
        "logging": LoggingConfig(wandb={"project": "rlhf-tests", "mode": "offline"})})
    ref = run_sft(cfg, micro_model)
    verify(ref)
    m = read_manifest(ref.path)
    assert (m.kind, m.stage, m.parent) == ("full", "sft", micro_model.digest)
    losses = _losses(ref)
    assert len(losses) == 6
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2  # it learned
    # the same global batches split over 2 ranks x 2 micro-batches (ZeRO-3) instead of 1 rank x 2
    # micro-batches (ZeRO-2): the same per-step losses, up to float summation order
    assert max(abs(a - b) for a, b in zip(losses, _losses(one_rank_run))) < 1e-5
    run_dir = Path(ref.path).parent
    assert (run_dir / "tensorboard").is_dir() and any((run_dir / "tensorboard").iterdir())
    # the exported folder is the engine's model: same logits as the ZeRO-3 engine at the end
    probe = load_file(str(run_dir / "final_probe.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], position_ids=probe["position_ids"], use_cache=False).logits
    assert torch.allclose(logits, probe["logits"], atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32)
    changed = [n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(changed) == len(list(base.parameters()))  # every parameter moved
    # held-out loss at steps 3 and 6, logged beside the training loss; the last one is the exported model's
    # mean NLL per target token on the eval examples, computed here with transformers
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "eval_loss" in s] == [3, 6]
    examples, _ = prepare_sft(cfg.eval_data, AutoTokenizer.from_pretrained(ref.path))
    nll = n = 0.0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.input_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(ex.loss_mask[1:], dtype=torch.float32)
            nll -= float((picked * mask).sum())
            n += float(mask.sum())
    assert steps[-1]["eval_loss"] == pytest.approx(nll / n, rel=1e-4)
    # logging.wandb (offline): the W&B run is the run folder's, its rows the metrics.jsonl rows (rank 0 only)
    run_id, rows = wandb_history(run_dir)
    assert run_id == run_dir.name
    assert [r["_step"] for r in rows] == [s["step"] for s in steps]
    assert [r["train/loss"] for r in rows] == [s["loss"] for s in steps]
    assert [r["train/eval_loss"] for r in rows if "train/eval_loss" in r] == [s["eval_loss"] for s in steps if "eval_loss" in s]
    assert no_worker_processes(tmp_path) == []


def test_interrupted_then_resumed_run_matches_uninterrupted(task_files, micro_model, one_rank_run, tmp_path, monkeypatch):
    expected = _losses(one_rank_run)
    cfg = _config(task_files, tmp_path, save_steps=2)
    monkeypatch.setenv("RLHF_FAULT_STEP", "3")
    monkeypatch.setenv("RLHF_FAULT_MODE", "exit")  # the rank dies as if killed, after step 3
    with pytest.raises(StageFailed, match="rank 0 died with exit code 3"):
        run_sft(cfg, micro_model)
    monkeypatch.delenv("RLHF_FAULT_STEP")
    run_dir = next(tmp_path.glob("sft-*"))
    assert not (run_dir / "checkpoint").exists()
    resumed = run_sft(cfg.model_copy(update={"train": cfg.train.model_copy(update={"resume": True})}), micro_model)
    got = _losses(resumed)
    assert len(got) == len(expected) == 6
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-6
    final = load_file(str(Path(resumed.path) / "model.safetensors"))
    reference = load_file(str(Path(one_rank_run.path) / "model.safetensors"))
    assert max((final[k] - reference[k]).abs().max().item() for k in reference) < 1e-6


def test_failing_rank_surfaces_its_traceback_and_leaves_no_process(task_files, micro_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_FAULT_STEP", "1")
    monkeypatch.setenv("RLHF_FAULT_RANK", "1")
    with pytest.raises(StageFailed, match=r"(?s)rank 1 failed:.*RuntimeError: injected fault at step 1 on rank 1"):
        run_sft(_config(task_files, tmp_path, world_size=2, micro_train_batch_size=2), micro_model)
    assert no_worker_processes(tmp_path) == []
    assert not list(tmp_path.glob("sft-*/checkpoint"))
    assert not list(tmp_path.glob("sft-*/.checkpoint.partial-*"))


def test_hung_rank_fails_the_stage_at_its_deadline_and_leaves_no_process(task_files, micro_model, tmp_path, monkeypatch):
    import time

    from stages.common.launcher import StageTimeout

    monkeypatch.setenv("RLHF_FAULT_STEP", "1")
    monkeypatch.setenv("RLHF_FAULT_MODE", "hang")  # rank 0 never returns after step 1
    t = time.monotonic()
    with pytest.raises(StageTimeout, match=r"no result within its deadline of 40 s; rank\(s\) \[0\] of 1 still running"):
        run_sft(_config(task_files, tmp_path, timeout_s=40), micro_model)
    assert time.monotonic() - t < 40 + 25  # the deadline, plus the launcher's SIGTERM grace and the data prep
    assert no_worker_processes(tmp_path) == []
    assert not list(tmp_path.glob("sft-*/checkpoint"))


def test_lora_with_gradient_checkpointing_saves_an_adapter_for_its_base(task_files, micro_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # with gradient checkpointing, which LoRA needs input gradients for
    cfg = _config(task_files, tmp_path, max_steps=3, lr=1e-2, gradient_checkpointing=True)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 4, "alpha": 8})})
    ref = run_sft(cfg, micro_model)
    m = read_manifest(ref.path)
    assert (m.kind, m.base, m.parent) == ("adapter", micro_model.digest, micro_model.digest)
    assert "adapter_model.safetensors" in m.files and "model.safetensors" not in m.files
    base = AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32)
    ids = torch.tensor([[1, 4, 22, 16, 23, 2, 5]])
    before = base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(base, ref.path)
    assert not torch.allclose(adapted(input_ids=ids).logits, before)  # the adapter learned something


def test_bad_input_stops_before_any_rank_starts(task_files, micro_model, tmp_path):
    with pytest.raises(ValueError, match=r"train_batch_size: 10 is not divisible by micro_train_batch_size \(4\) x world_size \(1\)"):
        _config(task_files, tmp_path, train_batch_size=10)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  paths: [x.jsonl]\ntrain:\n  learning_rate: 0.1\n")
    with pytest.raises(RecipeError, match=r"r.yaml: invalid config.*\n  train.learning_rate: unknown key \(value 0.1\)"):
        load_config(SFTConfig, [str(recipe)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n{"text": "x"}\n')
    cfg = _config({"sft": bad}, tmp_path)
    with pytest.raises(DataError, match=r"bad.jsonl row 2: key 'messages' missing \(input_key='messages'"):
        run_sft(cfg, micro_model)
    small = _config(task_files, tmp_path, train_batch_size=4096, micro_train_batch_size=4)
    with pytest.raises(ValueError, match=r"fewer than train_batch_size=4096"):
        run_sft(small, micro_model)
    with pytest.raises(CheckpointError, match="not a model folder"):
        from stages.common.models import resolve_model

        resolve_model(str(task_files["sft"].parent), str(tmp_path))
    assert not list(tmp_path.glob("sft-*"))  # nothing was launched or written


@pytest.mark.parametrize("best,expect", [({"metric": "eval_loss", "mode": "min"}, "argmin"), ({"metric": "loss", "mode": "max"}, "first")],
                         ids=["eval_loss_min", "loss_max"])
def test_save_best_outputs_the_best_step_and_keeps_the_last_beside_it(task_files, micro_model, tmp_path, best, expect):
    """train.save_best: the stage's output is the step whose logged metric is best (checked against metrics.jsonl),
    its manifest names the step and value; the last step's weights are committed beside it (checkpoint-last).
    ZeRO-3 on two ranks (the export is collective). loss/max picks step 1, so best and last must differ."""
    data = _config(task_files, tmp_path, world_size=2, zero_stage=3, micro_train_batch_size=2).model_dump()
    data["train"]["save_best"], data["eval_steps"] = best, 1
    data["eval_data"] = {"paths": [str(task_files["sft"])], "input_key": "messages", "output_key": None, "max_len": 64, "max_samples": 16}
    ref = run_sft(SFTConfig.model_validate(data), micro_model)
    run_dir = Path(ref.path).parent
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r[best["metric"]] for r in rows]
    step = rows[values.index(min(values) if best["mode"] == "min" else max(values))]["step"]
    if expect == "first":
        assert step == 1
    m = read_manifest(ref.path)
    assert m.extra["best"] == {"metric": best["metric"], "mode": best["mode"], "step": step, "value": pytest.approx(values[step - 1])}
    last = run_dir / "checkpoint-last"
    assert m.extra["last"] == verify(last).digest and read_manifest(last).extra["last_step"] is True
    verify(ref)
    weights, last_weights = load_file(str(Path(ref.path) / "model.safetensors")), load_file(str(last / "model.safetensors"))
    assert weights.keys() == last_weights.keys()
    same = all(torch.equal(weights[k], last_weights[k]) for k in weights)
    assert same == (step == len(rows)), (step, len(rows))
    assert not (run_dir / "best").exists()  # committed as checkpoint


def test_save_best_on_a_held_out_metric_without_held_out_data_is_refused():
    with pytest.raises(ValueError, match=r"train.save_best.metric: 'eval_loss' is a held-out metric and eval_data is not set"):
        SFTConfig.model_validate({"data": {"paths": ["x.jsonl"]}, "train": {"save_best": {"metric": "eval_loss"}}})


def test_the_cli_returns_a_committed_identity_at_once_and_a_killed_refresh_leaves_the_record_matching_its_checkpoint(
        task_files, micro_model, tmp_path):
    """A finished stage's CLI run again (same identity) returns the committed checkpoint without training; --refresh
    killed midway leaves the folder's metrics.jsonl and TensorBoard events byte for byte as they were (the record of
    the checkpoint still there); a refresh that completes replaces both together."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "stages.sft", "recipes/sft/tiny.yaml", f"base={micro_model.path}", f"output_root={tmp_path}",
            f"data.paths=[{task_files['sft']}]", "data.input_key=messages", "data.output_key=null", "data.max_len=64",
            "train.max_steps=4", "train.train_batch_size=8", "train.micro_train_batch_size=8", "train.dtype=fp32",
            "train.progress_bar=false", "train.save_steps=0"]

    def cli(*extra, **env):
        return subprocess.run([*args, *extra], cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **env})

    def printed(proc) -> dict:  # the reference the CLI prints last (DeepSpeed's lines may come before it)
        out = "\n" + proc.stdout
        return json.loads(out[out.rindex("\n{") + 1:])

    first = cli()
    assert first.returncode == 0, first.stderr
    ref = printed(first)
    run_dir = Path(ref["path"]).parent

    def record():
        files = [run_dir / "metrics.jsonl", *sorted((run_dir / "tensorboard").rglob("*"))]
        return {f.relative_to(run_dir).as_posix(): f.read_bytes() for f in files if f.is_file()}

    before, created = record(), read_manifest(ref["path"]).created
    assert [json.loads(ln)["step"] for ln in before["metrics.jsonl"].decode().splitlines()] == [1, 2, 3, 4]
    again = cli()
    assert again.returncode == 0 and printed(again) == ref
    assert "already holds this run's output (same identity)" in again.stderr and "not rerun (--refresh trains again)" in again.stderr
    assert read_manifest(ref["path"]).created == created
    killed = cli("--refresh", RLHF_FAULT_STEP="2", RLHF_FAULT_MODE="exit")  # the rank dies after logging step 2
    assert killed.returncode != 0
    assert record() == before and read_manifest(ref["path"]).created == created
    verify(load_ref(ref["path"]))
    pending = [json.loads(ln)["step"] for ln in (run_dir / ".record.pending" / "metrics.jsonl").read_text().splitlines()]
    assert pending == [1, 2]  # the killed refresh's own record, beside the committed one
    done = cli("--refresh")
    assert done.returncode == 0, done.stderr
    after = printed(done)
    assert read_manifest(after["path"]).created != created and not (run_dir / ".record.pending").exists()
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] == pytest.approx(read_manifest(after["path"]).extra["final"]["loss"], rel=0, abs=0)
    # the committed TensorBoard events are the refreshes' (the killed one's too: it started at step 1 as well, and
    # TensorBoard's purge_step drops its steps), none of the first run's
    now = record()
    assert now["metrics.jsonl"] != before["metrics.jsonl"] and not set(now) & (set(before) - {"metrics.jsonl"})
