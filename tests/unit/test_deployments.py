"""prefect.yaml (work-pool deployments) and flows/deploy.py (`make serve`) declare the same deployments."""

from __future__ import annotations

from pathlib import Path

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
