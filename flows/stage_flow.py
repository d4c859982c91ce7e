"""One stage as a flow of its own, for stages that run on a work pool of their own (a pipeline recipe's
``work_pool:``): the pipeline's task for the stage starts a flow run of the deployment ``run-stage/<pool>`` and
waits for it (``flows.tasks.run_stage_on_pool``); a worker of that pool runs it here, exactly as the task would
in-process (``flows.tasks.execute_stage``: the stage in a subprocess, its progress and curves in the UI).

Deploy it once per pool (the deployment is named after the pool), from the project root:
``python -m flows.stage_flow deploy POOL [POOL ...]`` (= ``prefect --no-prompt deploy flows/stage_flow.py:run_stage_flow
--name POOL --pool POOL``, each pool a process pool that exists); ``make deploy STAGE_POOLS="gpu cpu"`` does both.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from prefect import flow

from flows.tasks import STAGE_FLOW, execute_stage
from stages import registry
from stages.common.stage import StageRun


@flow(name=STAGE_FLOW, log_prints=True, persist_result=True, result_serializer="json")
def run_stage_flow(name: str, run: dict[str, Any], config: dict[str, Any], inputs: dict[str, Any], reuse: bool = True,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """Stage ``name`` of a pipeline run (``run``: its identity; ``inputs``: its input checkpoints as plain data)."""
    stage_run = StageRun.model_validate(run)
    spec = registry.spec(stage_run.stage)
    return execute_stage(name, stage_run, config, spec.load_inputs(inputs), reuse, timeout_s).model_dump()


def deploy(pools: list[str]) -> None:
    """A ``run-stage/<pool>`` deployment on each pool (Prefect records this folder as the runs' working directory)."""
    from flows.pipeline import PROJECT_ROOT

    for pool in pools:
        subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "flows/stage_flow.py:run_stage_flow",
                        "--name", pool, "--pool", pool], cwd=PROJECT_ROOT, check=True)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "deploy":
        raise SystemExit("usage: python -m flows.stage_flow deploy POOL [POOL ...]")
    deploy(sys.argv[2:])
