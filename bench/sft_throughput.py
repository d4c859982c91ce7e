"""SFT throughput: packed rows against the padded-batch baseline, same model, data and steps.

Runs the real SFT stage twice on the tiny default model (bf16, 1 rank) and prints a table of
examples/s and target tokens/s; writes bench/results/sft_throughput.json.

Run: ``python -m bench.sft_throughput [steps=40]``
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from stages.common.models import resolve_model
from stages.common.recipe import load_config
from stages.sft import SFTConfig, run_sft

OUT = Path(__file__).parent / "results" / "sft_throughput.json"


def measure(name: str, overrides: list[str], root: str, base) -> dict:
    cfg = load_config(SFTConfig, ["recipes/sft/tiny.yaml", f"output_root={root}", "train.progress_bar=false",
                                  "train.save_steps=0", *overrides])
    ref = run_sft(cfg, base)
    run_dir = Path(ref.path).parent
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    items = json.loads((run_dir / "items.json").read_text())
    examples_per_item = 8000 / len(items) if cfg.data.packing else 1.0
    targets_per_item = sum(sum(it["loss_mask"][1:]) for it in items) / len(items)
    step_time = statistics.median(s["step_time_s"] for s in steps[2:])  # skip warm-up steps
    batch = cfg.train.train_batch_size
    return {
        "variant": name,
        "rows_per_step": batch,
        "examples_per_step": round(batch * examples_per_item, 1),
        "median_step_s": round(step_time, 4),
        "examples_per_s": round(batch * examples_per_item / step_time, 1),
        "target_tokens_per_s": round(batch * targets_per_item / step_time, 1),
        "final_loss": round(steps[-1]["loss"], 4),
    }


def main(argv: list[str] | None = None) -> None:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    steps = int(args.get("steps", 40))
    with tempfile.TemporaryDirectory() as root:
        base = resolve_model("tiny:tiny", root)
        rows = [
            measure("padded (baseline)", [f"train.max_steps={steps}", "data.packing=false",
                                          "train.train_batch_size=64", "train.micro_train_batch_size=64"], root, base),
            measure("packed", [f"train.max_steps={steps}"], root, base),
        ]
    rows[1]["speedup_examples_per_s"] = round(rows[1]["examples_per_s"] / rows[0]["examples_per_s"], 2)
    cols = list(rows[0])
    print("| " + " | ".join(cols + ["speedup_examples_per_s"]) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "1.0")) for c in cols + ["speedup_examples_per_s"]) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"steps": steps, "model": "tiny (3.4M, bf16, 1 rank, ZeRO-2)", "rows": rows}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
