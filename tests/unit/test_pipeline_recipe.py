"""Pipeline recipes are checked whole before anything runs; pass@k."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.pipeline import plan
from stages.common.recipe import RecipeError
from stages.eval import pass_at_k

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, stages: list[dict]) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "output_root": str(tmp_path / "runs"), "stages": stages}))
    return path


SFT = {"name": "sft", "stage": "sft", "recipe": "recipes/sft/tiny.yaml"}
RM = {"name": "rm", "stage": "reward_model", "recipe": "recipes/reward_model/tiny.yaml", "inputs": {"base": "sft"}}


def test_the_shipped_pipeline_plans(tmp_path):
    p = plan(ROOT / "recipes/pipelines/tiny.yaml", output_root=str(tmp_path))
    assert [s.spec.name for s in p.stages] == ["base", "sft", "rm", "dpo", "rl", "eval"]
    assert [s.output for s in p.stages] == ["policy", "policy", "reward", "policy", "policy", "report"]
    assert all(s.config.output_root == str(tmp_path) for s in p.stages)


def test_the_tool_task_pipeline_plans_with_its_tools_metrics_declared(tmp_path):
    p = plan(ROOT / "recipes/pipelines/tools.yaml", output_root=str(tmp_path))
    by = {s.spec.name: s for s in p.stages}
    assert list(by) == ["base", "sft", "rl", "eval"] and by["base"].config.tools
    assert by["rl"].config.rollout.tools == by["eval"].config.tools == "recipes/tools/calculator.py"
    from stages import registry

    declared = registry.spec("rl").metrics(by["rl"].config)
    assert {"tool_calls", "tool_calls_calculator", "eval_tool_calls", "turns", "called_tool"} <= declared.names
    assert {"tool_calls", "turns", "episode_reward"} <= registry.spec("eval").metrics(by["eval"].config).names


def test_the_own_model_recipe_plans_offline_with_hub_ids(tmp_path, monkeypatch):
    """The README's recipe for a user's own model and data: planning reads no model or dataset."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = plan(ROOT / "recipes/pipelines/own_model.yaml", output_root=str(tmp_path))
    by = {s.spec.name: s.config for s in p.stages}
    assert by["sft"].base == "Qwen/Qwen2.5-0.5B-Instruct" and by["rm"].data.paths == ["HuggingFaceH4/ultrafeedback_binarized"]
    assert by["rm"].data.score_keys == ("score_chosen", "score_rejected")  # the margin: the RM's (DPO takes none)
    assert (by["rl"].data.subset, by["rl"].eval_grader, by["eval"].grader) == ("main", "math", "math")
    assert by["rl"].reward.func == "stages.common.graders:math_reward_func"
    assert not list(tmp_path.iterdir())  # nothing written, nothing fetched


@pytest.mark.parametrize("stages, match", [
    ([{**SFT, "stage": "sfft"}], r"stages\[0\] \(sft\)\.stage: unknown stage 'sfft'"),
    ([{"name": "dpo", "stage": "dpo", "recipe": "recipes/dpo/tiny.yaml", "inputs": {"policy": "sft"}}, SFT],
     r"stages\[0\] \(dpo\)\.inputs\.policy: 'sft' is not an earlier stage \(it runs later"),
    ([SFT, {**RM, "inputs": {"base": "sfx"}}], r"stages\[1\] \(rm\)\.inputs\.base: 'sfx' is not an earlier stage"),
    ([SFT, {**SFT, "overrides": {"train.lr": "fast"}, "name": "sft2"}], r"stages\[1\] \(sft2\).*\n\s+train\.lr: .*'fast'"),
    ([{**SFT, "overrides": {"trian.lr": 1e-3}}], r"stages\[0\] \(sft\).*\n\s+trian: unknown key"),
    ([SFT, RM, {"name": "dpo", "stage": "dpo", "recipe": "recipes/dpo/tiny.yaml", "inputs": {"policy": "rm"}}],
     r"inputs\.policy: stage 'rm' outputs a checkpoint of kind 'reward', but policy takes 'policy'"),
    ([SFT, {"name": "merge", "stage": "lora_merge", "inputs": {"adapter": "sft"}}],
     r"inputs\.adapter: stage 'sft' outputs a checkpoint of kind 'policy', but adapter takes 'adapter'"),
    ([SFT, {"name": "eval", "stage": "eval", "recipe": "recipes/eval/tiny.yaml"}], r"\(eval\)\.inputs\.models: required"),
    ([SFT, {**RM, "inputs": {"policy": "sft"}}], r"inputs\.policy: the reward_model stage takes no input 'policy'"),
    ([SFT, {**SFT}], r"stages\[1\] \(sft\)\.name: 'sft' is used by an earlier stage"),
    ([{**SFT, "recipe": "recipes/sft/nope.yaml"}], r"stages\[0\] \(sft\)\.recipe: .*nope.yaml: recipe file not found"),
])
def test_bad_pipelines_are_rejected_with_the_field_path(tmp_path, stages, match):
    path = write(tmp_path, stages)
    with pytest.raises(RecipeError, match=match) as e:
        plan(path)
    assert str(path) in str(e.value)


def test_lora_stages_produce_adapters_and_merges_give_back_the_kind(tmp_path):
    lora = {**SFT, "overrides": {"lora.rank": 4}}
    rm_lora = {**RM, "overrides": {"lora.rank": 4}, "inputs": {"base": "base"}}  # an adapter is no base
    p = plan(write(tmp_path, [{"name": "base", "stage": "tiny_model"}, {**lora, "inputs": {"base": "base"}}, rm_lora,
                              {"name": "m1", "stage": "lora_merge", "inputs": {"adapter": "sft", "base": "base"}},
                              {"name": "m2", "stage": "lora_merge", "inputs": {"adapter": "rm", "base": "base"}}]))
    assert [s.output for s in p.stages] == ["policy", "adapter", "reward_adapter", "policy", "reward"]


def test_pass_at_k_against_hand_computed_values():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # 1 - C(6,4)/C(8,4)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k wrong: some k-subset... every k-subset has a right one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction right
