"""Sweeps (flows/sweeps.py): the plan's variant copies, their inputs and overrides."""

import pytest

from flows.pipeline import StagePlan
from flows.sweeps import SweepConfig, expand
from stages.common.recipe import RecipeError

STAGES = [StagePlan(name="base", stage="tiny_model"), StagePlan(name="sft", stage="sft", inputs={"base": "base"}),
          StagePlan(name="rl", stage="rl", inputs={"policy": "sft"}, overrides={"max_steps": 3}, gates=["rl.reward_mean > sft.loss"]),
          StagePlan(name="eval", stage="eval", inputs={"models": ["sft", "rl"], "reference": "sft"})]


def test_a_grid_copies_the_swept_stage_and_what_follows_it_once_per_combination():
    sweep = SweepConfig(grid={"rl.algo.advantage_estimator": ["group_norm", "rloo"], "rl.train.lr": [1e-5, 3e-5]})
    stages, variants = expand(STAGES, sweep, "p.yaml")
    names = [s.name for s in stages]
    assert names == ["base", "sft", "rl-v0", "rl-v1", "rl-v2", "rl-v3", "eval-v0", "eval-v1", "eval-v2", "eval-v3"]
    by = {s.name: s for s in stages}
    assert by["rl-v3"].overrides == {"max_steps": 3, "algo.advantage_estimator": "rloo", "train.lr": 3e-5}
    assert by["rl-v1"].inputs == {"policy": "sft"} and by["rl-v1"].gates == ["rl-v1.reward_mean > sft.loss"]
    assert by["eval-v2"].inputs == {"models": ["sft", "rl-v2"], "reference": "sft"} and by["eval-v2"].overrides == {}
    assert variants[1] == {"label": "v1", "overrides": {"rl": {"algo.advantage_estimator": "group_norm", "train.lr": 3e-5}},
                           "stages": {"rl": "rl-v1", "eval": "eval-v1"}}


def test_listed_variants_and_bad_sweeps():
    stages, variants = expand(STAGES, SweepConfig(variants=[{"sft.train.lr": 1e-3}, {"sft.train.lr": 3e-3}]), "p.yaml")
    assert [s.name for s in stages] == ["base", "sft-v0", "sft-v1", "rl-v0", "rl-v1", "eval-v0", "eval-v1"]
    assert {s.name: s.inputs for s in stages}["eval-v1"] == {"models": ["sft-v1", "rl-v1"], "reference": "sft-v1"}
    with pytest.raises(RecipeError, match=r"p.yaml: sweep key 'rlx.train.lr': expected <stage>.<dotted key> with a stage"):
        expand(STAGES, SweepConfig(grid={"rlx.train.lr": [1e-5]}), "p.yaml")
    with pytest.raises(ValueError, match="give grid .* or variants"):
        SweepConfig()
