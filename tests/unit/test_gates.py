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


def _sweep_with(tmp_path, gates=None, rl_overrides=None):
    """recipes/pipelines/sweep.yaml, its eval stage's gates (and its RL stage's overrides) replaced."""
    import yaml

    from stages.common.stage import PROJECT_ROOT

    data = yaml.safe_load((PROJECT_ROOT / "recipes/pipelines/sweep.yaml").read_text())
    data["output_root"] = str(tmp_path / "runs")
    stages = {s["name"]: s for s in data["stages"]}
    if gates is not None:
        stages["eval"]["gates"] = gates
    stages["rl"]["overrides"].update(rl_overrides or {})
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("gate, error", [
    ("eval.rl.acuracy >= 0.1", r"'eval-v0.rl-v0.acuracy >= 0.1': the eval stage 'eval-v0' logs no metric 'acuracy'; did you mean "
                               r"'accuracy'\? \(it logs: accuracy, kl_to_reference, n, pass@k, response_length, reward\)"),
    ("eval.rll.accuracy >= 0.1", r"the eval stage 'eval-v0' reports no model 'rll'; did you mean 'rl'\? \(its models: sft, rl-v0\)"),
    ("rl.eval_acuracy >= sft.loss", r"the rl stage 'rl-v0' logs no metric 'eval_acuracy'; did you mean 'eval_accuracy'\?"),
    ("eval.rl.accuracy >= sft.eval_loss", r"the sft stage 'sft' logs no metric 'eval_loss'; did you mean 'loss'\? \(it logs: clipped, "
                                          r"dropped, grad_norm, kept, loss, loss_tokens, lr, rows, step, step_time_s, steps, tokens_per_s, truncated\)"),
])
def test_a_gate_on_a_metric_no_stage_logs_fails_at_planning_naming_it(tmp_path, gate, error):
    from flows.pipeline import plan

    with pytest.raises(RecipeError, match=rf"sweep.yaml: stages\[5\] \(eval-v0\)\.gates: .*{error}"):
        plan(_sweep_with(tmp_path, [gate]))


def test_a_gate_may_name_every_metric_its_stage_logs_the_reward_function_s_extra_logs_too(tmp_path):
    from flows.pipeline import plan

    reward = tmp_path / "reward.py"  # the arithmetic reward plus a per-batch extra_logs entry, found by the dry call
    reward.write_text("from stages.common.graders import arithmetic_correct\n\n\ndef reward_func(queries, prompts, labels):\n"
                      "    r = [float(arithmetic_correct(q[len(p):], lab)) for q, p, lab in zip(queries, prompts, labels)]\n"
                      "    return {'rewards': r, 'extra_logs': {'answered': sum(r) / len(r)}}\n")
    p = plan(_sweep_with(tmp_path, ["eval.rl.accuracy >= eval.sft.accuracy", "eval.rl.pass@k > 0.1"],
                         {"reward.func": str(reward), "train.save_best": {"metric": "eval_accuracy", "mode": "max"}}))
    assert [g.left for g in p.gates] == ["eval-v0.rl-v0.accuracy", "eval-v0.rl-v0.pass@k"] * 1 + \
        ["eval-v1.rl-v1.accuracy", "eval-v1.rl-v1.pass@k", "eval-v2.rl-v2.accuracy", "eval-v2.rl-v2.pass@k"]
    rl = next(s for s in p.stages if s.spec.name == "rl-v0")
    declared = rl.stage.metrics(rl.config)
    assert {"answered", "eval_accuracy", "reward_mean", "policy_loss", "generate_s"} <= declared.names and declared.open is None
    # a critic's metrics only with an estimator that has one
    assert "critic_loss" not in declared.names
    assert "critic_loss" in rl.stage.metrics(rl.config.model_copy(update={"algo": rl.config.algo.model_copy(
        update={"advantage_estimator": "gae"})})).names


@pytest.mark.parametrize("body, error", [
    ("def reward_func(q, p, l):\n    return {'rewards': [1.0]}\n", r"'rewards' has 1 values for 2 samples; expected a list"),
    ("def reward_func(q, p, l):\n    return {'rewards': [0.0, 1.0], 'extra_logs': {'x': [1, 2, 3]}}\n", r"'extra_logs.x' has 3 values"),
    ("def reward_func(q, p, l):\n    return {'rewards': [l[0].upper(), 0]}\n", r"'rewards' is not numeric"),
])
def test_a_reward_function_s_wrong_answer_fails_at_planning(tmp_path, body, error):
    from flows.pipeline import plan

    reward = tmp_path / "bad_reward.py"
    reward.write_text(body)
    with pytest.raises(RecipeError, match=rf"stages\[2\] \(rl-v0\): reward func {reward}: {error}"):
        plan(_sweep_with(tmp_path, rl_overrides={"reward.func": str(reward)}))
    # reward.check_call: false skips the dry call (its extra_logs are then open to gates)
    p = plan(_sweep_with(tmp_path, ["eval.rl.accuracy >= 0"], {"reward.func": str(reward), "reward.check_call": False}))
    rl = next(s for s in p.stages if s.spec.name == "rl-v0")
    assert "reward.check_call is off" in rl.stage.metrics(rl.config).open


def test_the_command_line_refuses_a_typo_d_gate_before_anything_runs(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from stages.common.stage import PROJECT_ROOT

    recipe = _sweep_with(tmp_path, ["eval.rl.acuracy >= 0.1"])
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.full_rlhf", str(recipe)], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}, timeout=300)
    elapsed = time.monotonic() - t
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "logs no metric 'acuracy'; did you mean 'accuracy'?" in line and line.startswith("python -m flows.full_rlhf: ")
    # nothing ran: no run folder, no Prefect server (its database) started
    assert not (tmp_path / "runs").exists() and not list((tmp_path / "prefect").glob("*.db"))
    print(f"refused in {elapsed:.1f} s")


def test_save_best_on_a_metric_the_stage_does_not_log_is_refused_by_its_cli(tmp_path, task_files):
    import subprocess
    import sys

    from stages.common.stage import PROJECT_ROOT

    proc = subprocess.run([sys.executable, "-m", "stages.sft", "recipes/sft/tiny.yaml", f"data.paths=[{task_files['sft']}]",
                           f"output_root={tmp_path}", "train.save_best={metric: los, mode: min}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "train.save_best.metric: 'los': the sft stage logs no metric 'los'; did you mean 'loss'?" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_eval_stage_whose_pass_k_exceeds_its_samples_fails_at_planning(tmp_path):
    import yaml

    from flows.pipeline import plan

    path = _sweep_with(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["stages"][3]["overrides"] = {"num_samples": 2, "pass_k": 4}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"(?s)stages\[\d\] \(eval-v0\).*pass_k=4 needs num_samples >= pass_k \(got num_samples=2\)"):
        plan(path)
