"""prefect.yaml (work-pool deployments) and flows/deploy.py (`make serve`) declare the same deployments."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_prefect_yaml_and_served_deployments_agree():
    from flows.deploy import NIGHTLY_CRON, deployments

    declared = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    served = {d.name: d for d in deployments()}
    assert sorted(d["name"] for d in declared) == sorted(served) == ["nightly", "tiny"]
    for d in declared:
        s = served[d["name"]]
        assert d["entrypoint"] == s.entrypoint
        assert (ROOT / d["entrypoint"].split(":")[0]).is_file()
        assert d.get("parameters", {}) == s.parameters
        assert d["description"] == s.description
        assert [c["cron"] for c in d.get("schedules", [])] == [x.schedule.cron for x in s.schedules]
        assert d["work_pool"]["name"] == "rlhf-local"
    assert [c["cron"] for c in next(d for d in declared if d["name"] == "nightly")["schedules"]] == [NIGHTLY_CRON]


def test_a_deployment_runs_overrides_may_not_name_code_unless_the_deployment_allows_it():
    from flows.full_rlhf import refuse_code_overrides
    from stages.common.recipe import RecipeError

    code = {"rl": {"reward.func": "evil.py"}}
    refuse_code_overrides(code, None)  # not a deployment run: the user's own machine and code
    refuse_code_overrides(code, True)  # deployed with allow_code_overrides: true
    refuse_code_overrides({"rl": {"train.lr": 1e-4, "rollout.n_samples_per_prompt": 4}}, False)
    for stage, key, field in (("rl", "reward.func", "reward.func"), ("rl", "reward", "reward.func"),
                              ("rl", "rollout.agent", "rollout.agent"), ("eval", "grader", "grader"),
                              ("rl", "eval_grader", "eval_grader")):
        with pytest.raises(RecipeError, match=rf"^overrides\.{stage}\.{key}: names code for the stage to run \({field}\); "
                                              r"a deployment run can't set it unless .*allow_code_overrides: true"):
            refuse_code_overrides({stage: {key: "x.py"}}, False)
