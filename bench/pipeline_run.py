"""`make run`'s two timings: the full-rlhf flow on the embedded default cold, then again at once (all Cached).

Each run is ``python -m flows.full_rlhf recipes/pipelines/tiny.yaml`` in a subprocess, as ``make run``
does, with a fresh output root and Prefect home for the cold run (so nothing is cached), then the same
command again. Prints a table of wall time and task states per run and writes bench/results/pipeline_run.json.

Run: ``python -m bench.pipeline_run [--root runs/bench-pipeline] [--pipeline recipes/pipelines/tiny.yaml]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "pipeline_run.json"
STATE = re.compile(r"Task run '([\w-]+)' - Finished in state (\w+)")


def run_once(pipeline: str, root: Path, env: dict[str, str], log: Path) -> dict:
    t = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, "-m", "flows.full_rlhf", pipeline, "--output-root", str(root)],
                               cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t
    states = dict(STATE.findall(log.read_text()))
    return {"wall_s": round(wall, 1), "exit_code": code, "states": states, "log": str(log)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline_run", description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="runs/bench-pipeline")
    ap.add_argument("--pipeline", default="recipes/pipelines/tiny.yaml")
    args = ap.parse_args(argv)
    root = (ROOT / args.root).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
    rows = {"cold": run_once(args.pipeline, root, env, root / "cold.log")}
    rows["cached"] = run_once(args.pipeline, root, env, root / "cached.log")
    print("| run | wall (s) | exit | task states |\n|---|---|---|---|")
    for name, r in rows.items():
        states = ", ".join(f"{k}: {v}" for k, v in r["states"].items())
        print(f"| {name} | {r['wall_s']} | {r['exit_code']} | {states} |")
    result = {"pipeline": args.pipeline, "cpu_count": os.cpu_count(), **rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT}")
    if any(r["exit_code"] for r in rows.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
