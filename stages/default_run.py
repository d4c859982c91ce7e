"""The embedded default, end to end: tiny model -> SFT -> reward model and DPO -> held-out eval.

``make run`` runs this. Every step goes through the stage functions and recipes a user runs
(``recipes/*/tiny.yaml``); ``key=value`` arguments override the SFT recipe (e.g. ``output_root=...``).
Prints the held-out task accuracy of the base, SFT and DPO models and the reward model's pairwise
accuracy on held-out pairs, and writes them to ``<output_root>/default_run.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from stages.common.models import resolve_model
from stages.common.recipe import load_config
from stages.dpo import DPOConfig, run_dpo
from stages.eval import EvalConfig, run_eval
from stages.reward_model import RewardModelConfig, run_reward_model
from stages.sft import SFTConfig, run_sft


def main(argv: list[str] | None = None) -> dict:
    overrides = list(sys.argv[1:] if argv is None else argv)
    start = time.time()
    sft_cfg = load_config(SFTConfig, ["recipes/sft/tiny.yaml", *overrides])
    root = f"output_root={sft_cfg.output_root}"
    base = resolve_model(sft_cfg.base, sft_cfg.output_root)
    timings = {}

    t = time.time()
    sft = run_sft(sft_cfg, base)
    timings["sft_s"] = time.time() - t
    print(f"[run] SFT checkpoint: {sft.path}")

    t = time.time()
    rm = run_reward_model(load_config(RewardModelConfig, ["recipes/reward_model/tiny.yaml", root]), sft)
    timings["reward_model_s"] = time.time() - t
    from checkpoints import read_manifest

    rm_stats = read_manifest(rm.path).extra["reward_stats"]
    print(f"[run] reward model: {rm.path}")

    t = time.time()
    dpo = run_dpo(load_config(DPOConfig, ["recipes/dpo/tiny.yaml", root]), sft)
    timings["dpo_s"] = time.time() - t
    print(f"[run] DPO checkpoint: {dpo.path}")

    t = time.time()
    results = run_eval(load_config(EvalConfig, ["recipes/eval/tiny.yaml", root]), base, sft, dpo)
    timings["eval_s"] = time.time() - t
    rows = {name: results[f"{ref.stage}:{ref.digest[:8]}"] for name, ref in (("base", base), ("sft", sft), ("dpo", dpo))}
    print("\n| model | held-out accuracy (greedy) | mean response tokens |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['accuracy']:.1%} | {r['response_length']:.1f} |")
    print(f"\nreward model: pairwise accuracy on held-out pairs {rm_stats['eval_accuracy']:.1%} "
          f"(reward mean {rm_stats['reward_mean']:.3f}, std {rm_stats['reward_std']:.3f})")
    timings["total_s"] = time.time() - start
    summary = {"eval": rows, "reward_model": rm_stats, "timings": {k: round(v, 1) for k, v in timings.items()},
               "checkpoints": {"base": base.path, "sft": sft.path, "reward_model": rm.path, "dpo": dpo.path}}
    out = Path(sft_cfg.output_root) / "default_run.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"[run] done in {timings['total_s']:.0f} s; summary in {out}")
    return summary


if __name__ == "__main__":
    main()
