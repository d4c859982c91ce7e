"""Deployments, served from this process: ``full-rlhf/tiny`` and ``nightly-recipe-validation/nightly``.

``make serve`` starts a local Prefect server on 127.0.0.1 and then this (the process that picks up
and runs the deployments' flow runs: Prefect's ``serve``, a worker without a work pool). Then::

    prefect deployment run full-rlhf/tiny
    prefect deployment run full-rlhf/tiny --param refresh='["rl"]' --param overrides='{"rl": {"max_steps": 20}}'
    prefect deployment run nightly-recipe-validation/nightly

Run: ``python -m flows.deploy [--cron "0 3 * * *"]`` with ``PREFECT_API_URL`` pointing at the server.
"""

from __future__ import annotations

import argparse
import os

from prefect import serve

from flows.full_rlhf import DEFAULT_PIPELINE, full_rlhf
from flows.nightly import nightly_recipe_validation
from flows.pipeline import PROJECT_ROOT

NIGHTLY_CRON = "0 3 * * *"


def deployments(cron: str = NIGHTLY_CRON) -> list:
    return [
        full_rlhf.to_deployment(name="tiny", parameters={"pipeline": DEFAULT_PIPELINE},
                                description="the embedded default pipeline (recipes/pipelines/tiny.yaml)"),
        nightly_recipe_validation.to_deployment(name="nightly", cron=cron,
                                                description="every recipe under recipes/ validated at tiny scale"),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.split("\n")[0])
    ap.add_argument("--cron", default=NIGHTLY_CRON, help="schedule of the nightly recipe validation")
    args = ap.parse_args(argv)
    os.chdir(PROJECT_ROOT)  # recipes name data files relative to the project root
    serve(*deployments(args.cron))


if __name__ == "__main__":
    main()
