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


@pytest.mark.parametrize("select, error", [
    ({"metric": "sft.loss"}, r"sweep.select.metric 'sft.loss': names stage 'sft', which the sweep does not copy"),
    ({"metric": "eval.rl.acuracy"}, r"sweep.select.metric 'eval.rl.acuracy': the eval stage 'eval-v0' logs no metric 'acuracy'; "
                                    r"did you mean 'accuracy'\?"),
    ({"metric": "rl.eval_accuracy", "mode": "best"}, r"sweep.select.mode"),
])
def test_a_sweep_s_selection_metric_is_checked_at_planning(tmp_path, select, error):
    import yaml

    from flows.pipeline import plan
    from stages.common.stage import PROJECT_ROOT

    data = yaml.safe_load((PROJECT_ROOT / "recipes/pipelines/sweep.yaml").read_text())
    data["output_root"] = str(tmp_path)
    data["sweep"]["select"] = select
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=error):
        plan(tmp_path / "p.yaml")
    data["sweep"].pop("select")  # default: the first gate's left side, highest first
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    p = plan(tmp_path / "p.yaml")
    assert (p.select.metric, p.select.mode) == ("eval.rl.accuracy", "max")


def test_variants_are_labelled_by_their_overrides_and_ranked_by_the_selection_metric():
    from flows.sweeps import SelectConfig, comparison, label, markdown

    variants = [{"label": f"v{i}", "overrides": {"rl": {"algo.advantage_estimator": e}}, "stages": {"rl": f"rl-v{i}"}}
                for i, e in enumerate(["group_norm", "rloo", "reinforce_baseline"])]
    assert label(variants[1]) == "advantage_estimator=rloo"
    values = {"rl-v0": 0.25, "rl-v1": 0.5, "rl-v2": 0.125}
    comp = comparison(variants, {}, {}, {"rl-v2": "stage 'rl-v2' (rl) failed: boom"}, SelectConfig(metric="rl.eval_accuracy"),
                      lambda name: {"eval_accuracy": values[name]})
    assert [r["variant"] for r in comp["rows"]] == ["v1", "v0", "v2"] and comp["best"] == "v1"
    assert [r.get("selected") for r in comp["rows"]] == [0.5, 0.25, None]  # a failed variant is not ranked
    md = markdown(comp, None)
    assert "best: **advantage_estimator=rloo** (v1)" in md and "| **advantage_estimator=rloo** (best, v1) |" in md
    assert "| advantage_estimator=reinforce_baseline (v2) | rl.algo.advantage_estimator=reinforce_baseline | failed (rl-v2: stage" in md
    low = comparison(variants[:2], {}, {}, {}, SelectConfig(metric="rl.eval_accuracy", mode="min"),
                     lambda name: {"eval_accuracy": values[name]})
    assert low["best"] == "v0"
