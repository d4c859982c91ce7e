"""Screenshots of what a user sees in the Prefect UI after a run: the newest full-rlhf flow run's page, its
RL stage's training-curves artifact, its eval report, and the newest run summary, taken with headless Chromium
(Debian's ``chromium`` package).

Run, with ``make serve`` running and a finished ``prefect deployment run full-rlhf/tiny``:
``PREFECT_API_URL=http://127.0.0.1:4200/api .venv/bin/python docs/screenshots.py`` (writes docs/ui-*.png);
``--sweep``: the newest sweep comparison (after a run of ``recipes/pipelines/sweep.yaml``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent


def shoot(url: str, out: Path, width: int, height: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", "--virtual-time-budget=30000", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=180)
    print(f"{url} -> {out}")


def main() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", default="rl", help="the stage whose curves artifact to show")
    ap.add_argument("--sweep", action="store_true", help="only the newest sweep comparison (docs/ui-sweep-comparison.png)")
    args = ap.parse_args()
    api = os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    ui = api.removesuffix("/api")
    if args.sweep:
        with get_client(sync_client=True) as client:
            (art,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-comparison"])),
                                           sort=ArtifactSort.CREATED_DESC, limit=1) or [None]
        if art is None:
            raise SystemExit(f"no sweep-comparison artifact on {api}: run a pipeline with a sweep first")
        shoot(f"{ui}/artifacts/artifact/{art.id}", HERE / "ui-sweep-comparison.png", 1440, 1000)
        return
    keys = {f"{args.stage}-curves": f"ui-{args.stage}-curves.png", "eval-report-eval": "ui-eval-report.png"}
    with get_client(sync_client=True) as client:
        # the newest flow run that trained the stage (a later all-Cached run publishes no curves)
        (curves,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"{args.stage}-curves"])),
                                          sort=ArtifactSort.CREATED_DESC, limit=1) or [None]
        if curves is None:
            raise SystemExit(f"no {args.stage}-curves artifact on {api}: run the pipeline first")
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=list(keys))),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[curves.flow_run_id])))
        (summary,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pipeline-summary"])),
                                           sort=ArtifactSort.CREATED_DESC, limit=1)  # the newest run's summary
    found = {a.key: a for a in arts}
    if set(keys) - set(found):
        raise SystemExit(f"flow run {curves.flow_run_id} lacks the artifacts {sorted(set(keys) - set(found))}")
    shoot(f"{ui}/runs/flow-run/{curves.flow_run_id}", HERE / "ui-flow-run.png", 1440, 1100)
    for key, name in keys.items():
        shoot(f"{ui}/artifacts/artifact/{found[key].id}", HERE / name, 1440, 1500 if key.endswith("curves") else 1000)
    shoot(f"{ui}/artifacts/artifact/{summary.id}", HERE / "ui-pipeline-summary.png", 1440, 900)


if __name__ == "__main__":
    main()
