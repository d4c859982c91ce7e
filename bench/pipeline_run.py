"""`make run`'s two timings: the full-rlhf flow on the embedded default cold, then again at once (all Cached).

Each run is ``python -m flows.full_rlhf recipes/pipelines/tiny.yaml`` in a subprocess, as ``make run``
does, with a fresh output root and Prefect home for the cold run (so nothing is cached), then the same
command again. Prints a table of wall time and task states per run and writes bench/results/pipeline_run.json.
Then, in this process, what the cached run spends deciding that nothing reruns: planning the pipeline, and
every stage's identity (code closure, file digests) plus the verification of its committed output, with
each file hashed once; every stage must find the folder the flow wrote (same identity), else it fails.

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


def identity_cost(pipeline: str, root: Path) -> dict:
    """Seconds to plan, then to identify every stage and verify its committed output (as a cached flow run does)."""
    os.chdir(ROOT)
    from checkpoints import remembered_hashes
    from flows.pipeline import plan

    t = time.perf_counter()
    p = plan(pipeline, output_root=str(root))
    planned = time.perf_counter() - t
    outputs: dict = {}
    with remembered_hashes():
        for st in p.stages:
            _, run = st.identify(outputs)
            outputs[st.spec.name] = st.stage.existing(run)
            if outputs[st.spec.name] is None:
                raise SystemExit(f"{st.spec.name}: no finished output under {run.run_dir}: this process's identity differs from the flow's")
    return {"plan_s": round(planned, 2), "identify_and_verify_s": round(time.perf_counter() - t - planned, 2)}


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
    cost = identity_cost(args.pipeline, root)
    print(f"\ndeciding nothing reruns, in-process: plan {cost['plan_s']} s, identities + verified outputs of every stage "
          f"{cost['identify_and_verify_s']} s")
    result = {"pipeline": args.pipeline, "cpu_count": os.cpu_count(), **rows, "identity": cost}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT}")
    if any(r["exit_code"] for r in rows.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
