"""The tiny vision-language model (tiny-vl, Idefics3) through SFT, eval and RL on the built-in visual task, with the
real DeepSpeed, vLLM (CPU build, images as multi_modal_data), Ray and peft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoints import read_manifest
from stages.common.recipe import apply_overrides, read_recipe, validate
from tests.conftest import metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def visual(tmp_path_factory):
    from datasets_prep.visual_task import write_visual_task_files

    return write_visual_task_files(tmp_path_factory.mktemp("visual"), seed=1, sizes={"sft": 1200, "rl_prompts": 64, "eval": 64})


@pytest.fixture(scope="module")
def vl_base(tmp_path_factory):
    from stages.common.tiny import TinyModelConfig, run_tiny_model

    return run_tiny_model(TinyModelConfig(preset="tiny-vl", output_root=str(tmp_path_factory.mktemp("vl_base"))))


def _sft_config(visual, root, *overrides):
    from stages.sft import SFTConfig

    data, _ = read_recipe(ROOT / "recipes/sft/visual.yaml")
    micro = [f"data.paths=[{visual['sft']}]", f"output_root={root}", "train.num_epochs=4", "train.progress_bar=false"]
    return validate(SFTConfig, apply_overrides(data, [*micro, *overrides]), "recipes/sft/visual.yaml")


@pytest.fixture(scope="module")
def vl_sft(visual, vl_base, tmp_path_factory):
    from stages.sft import run_sft

    return run_sft(_sft_config(visual, tmp_path_factory.mktemp("vl_sft")), vl_base)


def test_vlm_sft_learns_the_pictures_and_eval_reports_them(visual, vl_base, vl_sft, tmp_path):
    """SFT on image prompts (each image's block out of the loss) beats chance on held-out pictures, which a text-only
    answer can't (tests/unit/test_images.py); the eval report shows sample pictures with each model's answer; the
    checkpoint loads with transformers' auto classes, its processor beside it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from stages.eval import EvalConfig, run_eval

    steps = metrics(vl_sft)
    assert steps[-1]["loss"] < 0.85 * steps[0]["loss"]
    AutoModelForImageTextToText.from_pretrained(vl_sft.path)
    assert type(AutoProcessor.from_pretrained(vl_sft.path)).__name__ == "Idefics3Processor"
    data, _ = read_recipe(ROOT / "recipes/eval/visual.yaml")
    cfg = validate(EvalConfig, apply_overrides(data, [f"data.paths=[{visual['eval']}]", f"output_root={tmp_path}", "num_samples=2",
                                                      "pass_k=2"]), "eval")
    report = run_eval(cfg, {"base": vl_base, "sft": vl_sft})
    base, sft = report.metrics["base"], report.metrics["sft"]
    assert base["accuracy"] <= 0.4 and sft["accuracy"] >= 0.4, report.metrics
    assert sft["pass@k"] >= sft["accuracy"] - 1e-9 and sft["response_length"] == pytest.approx(2.0, abs=0.5)
    md = Path(report.markdown).read_text()
    assert "Sample image prompts" in md and (Path(report.folder) / "sample-1-1.png").is_file()
    assert md.count("![row") == 4


def test_vlm_rl_trains_on_image_prompts_with_every_push_verified(visual, vl_sft, tmp_path):
    """GRPO on image prompts: vLLM's sampling log-probs equal the learner's (same pixels, image tokens banned on both
    sides) within 1e-5 in fp32, every push verified on an image probe, the vision tower frozen bit-exact while the
    language model moves; then LoRA on the language model: the adapter touches only its modules."""
    from safetensors.torch import load_file

    from stages.rl.config import RLConfig
    from stages.rl.driver import run_rl

    data, _ = read_recipe(ROOT / "recipes/rl/visual.yaml")
    micro = [f"data.paths=[{visual['rl_prompts']}]", f"eval_data.paths=[{visual['eval']}]", "eval_data.max_samples=16",
             "eval_steps=0", f"output_root={tmp_path}", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
             "train.train_batch_size=16", "train.micro_train_batch_size=8", "max_steps=2", "train.progress_bar=false",
             "train.freeze_vision_tower=true", "algo.advantage_estimator=rloo", "sync_tolerance=1e-5"]
    ref = run_rl(validate(RLConfig, apply_overrides(data, micro), "rl"), vl_sft)
    steps = metrics(ref)
    assert len(steps) == 2 and all(s["sync_logprob_diff"] <= 1e-5 and s["rollout_logprob_diff"] <= 1e-5 for s in steps)
    assert 0.0 <= steps[-1]["final_eval_accuracy" if "final_eval_accuracy" in steps[-1] else "eval_accuracy"] <= 1.0
    old, new = load_file(str(Path(vl_sft.path) / "model.safetensors")), load_file(str(Path(ref.path) / "model.safetensors"))
    tower = [k for k in old if k.startswith(("model.vision_model.", "model.connector."))]
    assert tower and all(torch.equal(old[k], new[k]) for k in tower)
    assert any(not torch.equal(old[k], new[k]) for k in old if k.startswith("model.text_model."))
    assert (Path(ref.path) / "processor_config.json").is_file()

    lora = run_rl(validate(RLConfig, apply_overrides(data, [*micro, "max_steps=1", f"output_root={tmp_path / 'lora'}",
                                                            'lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}']), "rl"), vl_sft)
    assert read_manifest(lora.path).kind == "adapter" and metrics(lora)[0]["sync_logprob_diff"] <= 1e-5
    adapted = json.loads((Path(lora.path) / "adapter_config.json").read_text())["target_modules"]
    assert "text_model" in adapted and "vision_model" not in adapted


def test_a_multi_turn_agent_that_answers_with_a_picture_trains_on_both_pictures(visual, vl_sft, tmp_path):
    """OpenRLHF's VLM agent contract: a wrong first answer is shown a second picture (``environment_images``, a chat
    turn with an image part); the episode's trajectory holds both pictures' blocks and the learners' forward takes
    both pictures' pixels: vLLM's sampling log-probs on every action equal the learner's within 1e-5 (fp32), every
    push verified."""
    from stages.rl.config import RLConfig
    from stages.rl.driver import run_rl

    data, _ = read_recipe(ROOT / "recipes/rl/visual.yaml")
    micro = [f"data.paths=[{visual['rl_prompts']}]", f"eval_data.paths=[{visual['eval']}]", "eval_data.max_samples=16",
             "eval_steps=0", f"output_root={tmp_path}", "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4",
             "train.train_batch_size=16", "train.micro_train_batch_size=8", "max_steps=2", "train.progress_bar=false",
             "algo.advantage_estimator=rloo", "sync_tolerance=1e-5", "rollout.agent=recipes/agents/visual_look_again.py",
             "rollout.max_turns=2", "rollout.max_model_len=128", "data.max_images_per_prompt=2", "eval_data.max_images_per_prompt=2",
             "reward={}", "eval_grader=null"]
    steps = metrics(run_rl(validate(RLConfig, apply_overrides(data, micro), "rl"), vl_sft))
    assert len(steps) == 2 and all(s["sync_logprob_diff"] <= 1e-5 and s["rollout_logprob_diff"] <= 1e-5 for s in steps)
    # a wrong first look (about half of them, from the SFT model) gets the second picture and a second action
    assert all(1.05 < s["turns"] < 1.95 for s in steps), [s["turns"] for s in steps]
    assert all(0.0 <= s["first_look_success"] <= 1.0 and 0.0 <= s["second_look_success"] <= 1.0 for s in steps)


def test_vlm_mistakes_are_refused_by_name_before_anything_starts(visual, vl_sft, micro_model, tmp_path):
    from datasets_prep.loading import DataError
    from stages.rl.config import RLConfig
    from stages.rl.driver import run_rl
    from stages.sft import run_sft

    data, _ = read_recipe(ROOT / "recipes/rl/visual.yaml")
    base = [f"data.paths=[{visual['rl_prompts']}]", f"eval_data.paths=[{visual['eval']}]", f"output_root={tmp_path}"]
    with pytest.raises(ValueError, match="advantage_estimator='gae' needs a critic"):
        run_rl(validate(RLConfig, apply_overrides(data, [*base, "algo.advantage_estimator=gae"]), "rl"), vl_sft)
    with pytest.raises(DataError, match="image_key is 'images' but the policy .* is not a vision-language model"):
        run_rl(validate(RLConfig, apply_overrides(data, base), "rl"), micro_model)
    with pytest.raises(DataError, match="data.image_key is 'images' but the model is not a vision-language model"):
        run_sft(_sft_config(visual, tmp_path), micro_model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "How many shapes?", "response": "1", "images": ["nowhere.png"]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl.* row 1: field 'images': image file 'nowhere.png' does not exist"):
        run_sft(_sft_config(visual, tmp_path, f"data.paths=[{bad}]"), vl_sft)
    assert not list(tmp_path.glob("rl-*/checkpoint")) and not list(tmp_path.glob("sft-*/checkpoint"))
