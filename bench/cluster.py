"""The SFT stage on one machine (local rank processes) against the same stage on a two-node Ray cluster
(``cluster.address``; ``stages.common.local_cluster``: two 1-CPU worker nodes on 127.0.0.1, one rank on each), the
same recipe in one run: start-up seconds (the stage's wall time less its steps) and the median step time.

``before=PATH`` adds the one-machine row run from another checkout of the project (e.g. a ``git worktree`` of the
commit before a change) — the single-machine default's time before and after, in the same run. Rows run in turns,
``rounds`` times; each row's figures are the median over its rounds.

Run: ``python -m bench.cluster [steps=30] [rounds=2] [before=/path/to/other/checkout] [cluster=0]`` (``cluster=0``: the
one-machine rows only); writes
``bench/results/cluster.json``.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "cluster.json"


def _start_cluster(folder: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    info = folder / "cluster.json"
    proc = subprocess.Popen([sys.executable, "-m", "stages.common.local_cluster", "--nodes", "2", "--info", str(info), "--stdin"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while time.time() < deadline:
        if info.is_file() and len(json.loads(info.read_text())["nodes"]) == 2:
            return proc, json.loads(info.read_text())["address"]
        if proc.poll() is not None:
            raise RuntimeError("the local cluster did not start")
        time.sleep(0.5)
    raise RuntimeError("the local cluster did not start within 180 s")


def run_stage(name: str, project: Path, root: Path, steps: int, extra: list[str], env: dict[str, str]) -> dict:
    args = [sys.executable, "-m", "stages.sft", "recipes/sft/tiny.yaml", f"output_root={root}", "train.world_size=2",
            "train.micro_train_batch_size=8", f"train.max_steps={steps}", "train.save_steps=0", "train.progress_bar=false", *extra]
    start = time.perf_counter()
    out = subprocess.run(args, cwd=project, env={**env, "PYTHONPATH": str(project)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"{name}: {out.stderr[-3000:]}")
    (run_dir,) = root.glob("sft-*")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "startup_s": wall - sum(r["step_time_s"] for r in rows),
            "step_s": statistics.median(r["step_time_s"] for r in rows[2:]), "final_loss": rows[-1]["loss"]}


def main(argv: list[str] | None = None) -> None:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    steps, rounds = int(args.get("steps", 30)), int(args.get("rounds", 2))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))  # one JIT build for every row
    variants: list[tuple[str, Path, list[str]]] = []
    if "before" in args:
        commit = subprocess.run(["git", "-C", args["before"], "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        variants.append((f"one machine, before ({commit or args['before']})", Path(args["before"]), []))
    variants.append(("one machine (local ranks)", ROOT, []))
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster, address = _start_cluster(Path(tmp), env) if args.get("cluster", "1") != "0" else (None, None)
        try:
            if cluster is not None:
                variants.append(("two-node Ray cluster (one rank per node)", ROOT,
                                 [f"cluster.address={address}", "cluster.strategy=STRICT_SPREAD"]))
            for r in range(rounds):
                for i, (name, project, extra) in enumerate(variants):
                    root = Path(tmp) / f"r{r}-{i}"
                    results.setdefault(name, []).append(run_stage(name, project, root, steps, extra, env))
        finally:
            if cluster is not None:
                cluster.stdin.close()
                cluster.wait(timeout=120)
    rows = [{"variant": name, **{k: round(statistics.median(x[k] for x in runs), 4) for k in runs[0]},
             "startup_s_per_round": [round(x["startup_s"], 2) for x in runs]} for name, runs in results.items()]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"steps": steps, "rounds": rounds, "cpu": _cpu(), "ranks": 2, "recipe": "recipes/sft/tiny.yaml",
                               "rows": rows}, indent=2))
    print(f"wrote {OUT}")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{os.cpu_count()} cores"


if __name__ == "__main__":
    main()
