"""The embedded default, end to end: tiny model -> SFT -> held-out accuracy of base and SFT.

``make run`` runs this. Every step goes through the same stage functions and recipes a user runs:
``recipes/sft/tiny.yaml`` and ``recipes/eval/tiny.yaml``.
"""

from __future__ import annotations

import sys
import time

from stages.common.models import resolve_model
from stages.common.recipe import load_config
from stages.eval import EvalConfig, run_eval
from stages.sft import SFTConfig, run_sft


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    start = time.time()
    sft_cfg = load_config(SFTConfig, ["recipes/sft/tiny.yaml", *overrides])
    base = resolve_model(sft_cfg.base, sft_cfg.output_root)
    print(f"[run] base model: {base.path}")
    sft = run_sft(sft_cfg, base)
    print(f"[run] SFT checkpoint: {sft.path}")
    eval_cfg = load_config(EvalConfig, ["recipes/eval/tiny.yaml", f"output_root={sft_cfg.output_root}"])
    results = run_eval(eval_cfg, base, sft)
    print("\n| model | held-out accuracy (greedy) | mean response tokens |\n|---|---|---|")
    for name, ref in (("base", base), ("sft", sft)):
        r = results[f"{ref.stage}:{ref.digest[:8]}"]
        print(f"| {name} | {r['accuracy']:.1%} | {r['response_length']:.1f} |")
    print(f"\n[run] done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
