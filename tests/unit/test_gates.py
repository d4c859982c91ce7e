"""Quality gates (flows/gates.py): parsing against the pipeline's stages, evaluation, the message, the result stage."""

import pytest

from flows.gates import GateFailed, check, evaluate, parse, result_stage
from stages.common.recipe import RecipeError

STAGES = {"base": "tiny_model", "sft": "sft", "rm": "reward_model", "rl": "rl", "eval": "eval"}
METRICS = {"sft": {"eval_accuracy": 0.15, "loss": 0.8}, "rl": {"eval_accuracy": 0.215, "reward_mean": 0.4},
           "rm": {"eval_accuracy": 0.94}, "eval": {"sft.accuracy": 0.15, "rl.accuracy": 0.215}}


def test_gates_compare_with_a_number_or_another_stages_metric_plus_a_margin():
    gates = [parse("rl.eval_accuracy >= sft.eval_accuracy + 0.05", "rl", STAGES), parse("rm.eval_accuracy >= 0.9", "rm", STAGES),
             parse("eval.rl.accuracy > eval.sft.accuracy", "eval", STAGES), parse("sft.loss < 1e-3", "sft", STAGES),
             parse("rl.eval_accuracy >= sft.eval_accuracy + 0.1", "rl", STAGES)]
    results = evaluate(gates, METRICS)
    assert [r.passed for r in results] == [True, True, True, False, False]
    assert results[0].value == pytest.approx(0.215) and results[0].threshold == pytest.approx(0.2)
    assert results[3].why == "sft.loss = 0.8 not < 0.001"
    assert results[4].why == "rl.eval_accuracy = 0.215 not >= sft.eval_accuracy + 0.1 = 0.25"
    with pytest.raises(GateFailed, match=r"^2 of 5 gate\(s\) failed: stage 'sft': sft.loss < 1e-3: sft.loss = 0.8 not < 0.001; "
                                         r"stage 'rl': .*= 0.25 \(the checkpoints stand; the run has no result\)"):
        check(results)
    check(results[:3])  # all passed: no error


def test_a_metric_a_stage_does_not_have_fails_its_gate_naming_what_it_has():
    (r,) = evaluate([parse("rm.accuracy >= 0.9", "rm", STAGES)], METRICS)
    assert not r.passed and r.why == "stage 'rm' has no metric 'accuracy' (it has: eval_accuracy)"


@pytest.mark.parametrize("text,error", [
    ("rl.eval_accuracy >= ", "expected '<stage>.<metric> <op> <number>'"),
    ("rl.eval_accuracy => 0.2", "expected"),
    ("rlx.eval_accuracy >= 0.2", "no stage named 'rlx'"),
    ("eval.accuracy >= 0.2", "'eval.accuracy' should read <eval>.<model>.<metric> (stage 'eval' is a eval stage)"),
    ("rl.a.b >= 0.2", "'rl.a.b' should read <stage>.<metric>"),
])
def test_a_malformed_gate_is_refused_by_name(text, error):
    with pytest.raises(RecipeError, match=r"^gates: " + repr(text).replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
                       .replace("+", r"\+") + ": .*" + error.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse(text, "rl", STAGES)


def test_the_result_is_the_last_gated_stage_or_the_model_an_eval_gate_names():
    order = list(STAGES)
    assert result_stage([], order, STAGES) is None
    assert result_stage([parse("rm.eval_accuracy >= 0.9", "rm", STAGES), parse("rl.reward_mean > 0", "rl", STAGES)], order, STAGES) == "rl"
    assert result_stage([parse("rl.reward_mean > 0", "rl", STAGES), parse("eval.rl.accuracy >= 0.2", "eval", STAGES)], order, STAGES) == "rl"


def test_a_pipeline_recipe_with_a_gate_on_an_unknown_stage_fails_to_plan_naming_it(tmp_path, task_files):
    import yaml

    from flows.pipeline import plan

    recipe = tmp_path / "p.yaml"
    recipe.write_text(yaml.safe_dump({"name": "g", "output_root": str(tmp_path), "stages": [
        {"name": "base", "stage": "tiny_model", "overrides": {"preset": "micro"}},
        {"name": "sft", "stage": "sft", "recipe": "recipes/sft/tiny.yaml", "inputs": {"base": "base"},
         "overrides": {"data.paths": [str(task_files["sft"])]}, "gates": ["sft.loss <= rl.loss"]}]}))
    with pytest.raises(RecipeError, match=rf"{recipe}: stages\[1\] \(sft\)\.gates: 'sft.loss <= rl.loss': no stage named 'rl'"):
        plan(recipe)
