"""Held-out accuracy gain of RL over the SFT model, per advantage estimator, on the embedded default.

Starts from an SFT checkpoint (``sft=PATH``, else the default SFT recipe is run first), runs the RL
recipe with each estimator, and reports greedy held-out accuracy before and after, the RL wall time,
the seed, the accuracy at every eval step with the (upper-bound) wall time it was reached by, and the
best gain reached within 10 minutes. Prints a table and writes bench/results/rl_gain.json.

Run: ``python -m bench.rl_gain [sft=PATH] [critic=PATH] [steps=60] [estimators=reinforce_baseline,group_norm,gae] [key=value ...]``
(``critic``: the checkpoint gae's critic starts from, e.g. the reward model stage's; default: the SFT policy;
``out``: the JSON to write, default bench/results/rl_gain.json)
(remaining ``key=value`` arguments override recipes/rl/tiny.yaml; the multi-turn example:
``estimators=reinforce_baseline rollout.agent=recipes/agents/arithmetic_retry.py reward.func=null out=bench/results/rl_gain_agent.json``;
the tool task: ``recipe=recipes/rl/tools.yaml sft_recipe=recipes/sft/tools.yaml estimators=group_norm steps=30
out=bench/results/rl_gain_tools.json``)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from checkpoints import load_ref, read_manifest
from stages.common.recipe import load_config
from stages.rl.config import RLConfig
from stages.rl.driver import run_rl

OUT = Path(__file__).parent / "results" / "rl_gain.json"
ROOT = Path(__file__).resolve().parents[1]


def timeline(metrics: list[dict], wall: float, before: float) -> dict:
    """Held-out accuracy at each eval step with the wall time it was reached by: the RL steps' own time
    (``total_s``) so far plus everything else of the run (start-up, the evals, the export), all counted as
    if spent before the first step (so the times are upper bounds). ``best_gain_within_600s``: the best
    gain over the SFT model among the eval points reached within 10 minutes."""
    overhead = wall - sum(m.get("total_s", 0.0) for m in metrics)
    elapsed, points = overhead, []
    for m in metrics:
        elapsed += m.get("total_s", 0.0)
        if "eval_accuracy" in m:
            points.append([m["step"], round(m["eval_accuracy"], 4), round(elapsed, 1)])
    within = [100 * (acc - before) for _, acc, t in points if t <= 600]
    return {"eval_accuracy_by_step": points, "best_gain_within_600s": round(max(within), 1) if within else None}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in ("sft", "critic", "steps", "estimators", "root", "out", "recipe", "sft_recipe")}
    overrides = [a for a in args if a.split("=", 1)[0] not in opts]
    root = opts.get("root", "runs")
    if "sft" in opts:
        sft = load_ref(opts["sft"])
    else:
        from stages.common.models import resolve_model
        from stages.sft import SFTConfig, run_sft

        cfg = load_config(SFTConfig, [str(ROOT / opts.get("sft_recipe", "recipes/sft/tiny.yaml")), f"output_root={root}"])
        sft = run_sft(cfg, resolve_model(cfg.base, root))
    rows = []
    for est in opts.get("estimators", "reinforce_baseline,group_norm,gae").split(","):
        cfg = load_config(RLConfig, [str(ROOT / opts.get("recipe", "recipes/rl/tiny.yaml")), f"output_root={root}", f"max_steps={opts.get('steps', 60)}",
                                     f"algo.advantage_estimator={est}", "train.progress_bar=false", *overrides])
        t = time.time()
        ref = run_rl(cfg, sft, critic=load_ref(opts["critic"]) if "critic" in opts else None)
        wall = time.time() - t
        extra = read_manifest(ref.path).extra
        metrics = [json.loads(ln) for ln in (Path(ref.path).parent / "metrics.jsonl").read_text().splitlines()]
        before, after = extra["initial_eval"]["eval_accuracy"], extra["final_eval"]["eval_accuracy"]
        rows.append({"estimator": est, "critic_init": opts.get("critic") if est == "gae" else None, "steps": cfg.max_steps, "seed": cfg.seed, "lr": cfg.train.lr,
                     "sft_accuracy": round(before, 4), "rl_accuracy": round(after, 4),
                     "gain_points": round(100 * (after - before), 1), "rl_wall_s": round(wall, 1), "checkpoint": ref.path,
                     **timeline(metrics, wall, before),
                     # an agent's own held-out metrics (e.g. eval_second_attempt_success), before and after RL
                     "other_eval": {k: [round(extra["initial_eval"].get(k, float("nan")), 4), round(v, 4)]
                                    for k, v in extra["final_eval"].items() if k != "eval_accuracy"}})
    cols = ["estimator", "steps", "seed", "lr", "sft_accuracy", "rl_accuracy", "gain_points", "rl_wall_s", "best_gain_within_600s"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
        for k, (b, a) in r["other_eval"].items():
            print(f"  {k}: {b} -> {a}")
    out = Path(opts.get("out", OUT))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sft": sft.path, "recipe": opts.get("recipe", "recipes/rl/tiny.yaml"), "overrides": overrides,
                               "machine": _cpu(), "rows": rows}, indent=2))
    print(f"wrote {out}")


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor()


if __name__ == "__main__":
    main()
