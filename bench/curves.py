"""What the live training-curves artifact costs a stage: the same SFT stage run through the full-rlhf flow
(a temporary Prefect server, the real task) with the curves drawn only once at the end, at the default
throttle (``flows.curves.MIN_INTERVAL_S``, every 10 s) and as often as the task's watcher looks (every 2 s),
side by side in one run, in turns (``rounds`` times each).

Reported per variant: the median step time and the training loop's total (from the stage's own
``metrics.jsonl``: ``step_time_s``, which the ranks time themselves), the number of curves updates and
what one costs (drawing the plot + table, publishing to the API), measured on the final log.

Run: ``python -m bench.curves [steps=100] [rounds=2]``; writes bench/results/curves.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

OUT = Path(__file__).parent / "results" / "curves.json"
VARIANTS = (("end only", float("inf")), ("every 10 s (default)", 10.0), ("every 2 s (the watcher's pace)", 0.0))


def pipeline(root: Path, steps: int) -> Path:
    stages = [{"name": "base", "stage": "tiny_model", "overrides": {"preset": "tiny"}},
              {"name": "sft", "stage": "sft", "recipe": "recipes/sft/tiny.yaml", "inputs": {"base": "base"},
               "overrides": {"train.max_steps": steps, "train.save_steps": 0, "train.progress_bar": False, "train.logging_steps": 1}}]
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "curves-bench", "output_root": str(root / "runs"), "stages": stages}))
    return path


def main(argv: list[str] | None = None) -> None:
    from prefect.testing.utilities import prefect_test_harness

    import flows.curves as curves
    from flows.full_rlhf import full_rlhf

    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    steps, rounds = int(args.get("steps", 100)), int(args.get("rounds", 2))
    runs: dict[str, list[dict]] = {name: [] for name, _ in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=120):
        recipe = pipeline(Path(tmp), steps)
        counted: list[curves.Curves] = []
        original = curves.Curves.update

        def counting(self, final: bool = False) -> bool:  # the real update, its instances kept to read their counters
            if self not in counted:
                counted.append(self)
            return original(self, final)

        curves.Curves.update = counting
        for r in range(rounds):
            for name, interval in VARIANTS:
                curves.MIN_INTERVAL_S = interval
                counted.clear()
                t0 = time.perf_counter()
                out = full_rlhf(str(recipe), refresh=["sft"], output_root=str(Path(tmp) / f"r{r}-{len(runs[name])}-{interval}"))
                wall = time.perf_counter() - t0
                log = Path(out["sft"]["path"]).parent / "metrics.jsonl"
                rows = [json.loads(ln) for ln in log.read_text().splitlines()]
                (c,) = [c for c in counted if c.stage == "sft"]
                runs[name].append({"median_step_s": statistics.median(x["step_time_s"] for x in rows[2:]),
                                   "train_loop_s": sum(x["step_time_s"] for x in rows), "flow_wall_s": wall,
                                   "updates": c.updates, "curves_s": c.seconds, "log": str(log)})
                print(f"round {r + 1} {name}: {runs[name][-1]}")
        curves.Curves.update = original
        # one update's parts, on the last run's final log
        rows = curves.load_rows(runs[VARIANTS[0][0]][-1]["log"])
        t0 = time.perf_counter()
        text = curves.markdown("sft", "sft", rows, "metrics.jsonl", final=True)
        draw_s = time.perf_counter() - t0

    base = statistics.mean(x["train_loop_s"] for x in runs[VARIANTS[0][0]])
    table = []
    for name, _ in VARIANTS:
        xs = runs[name]
        loop = statistics.mean(x["train_loop_s"] for x in xs)
        updates = statistics.mean(x["updates"] for x in xs)
        table.append({"variant": name, "updates_per_run": round(updates, 1),
                      "median_step_s": round(statistics.mean(x["median_step_s"] for x in xs), 4),
                      "train_loop_s": round(loop, 2), "vs_end_only": round(loop / base, 3),
                      "curves_s_per_update": round(statistics.mean(x["curves_s"] / max(x["updates"], 1) for x in xs), 3),
                      "flow_wall_s": round(statistics.mean(x["flow_wall_s"] for x in xs), 1)})
    cols = list(table[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in table:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    print(f"one update on the {len(rows)}-step log: draw {draw_s:.3f} s, artifact {len(text) / 1024:.0f} KiB")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"steps": steps, "rounds": rounds, "model": "tiny (3.4M, fp32, 1 rank)", "rows": table,
                               "draw_s_final_log": round(draw_s, 3), "artifact_kib": round(len(text) / 1024, 1)}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
