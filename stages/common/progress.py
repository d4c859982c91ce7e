"""Step progress for whoever runs a stage: ``{"step", "total", "metrics", "eval"}`` written to
``$RLHF_PROGRESS_FILE`` (``metrics``: the last step's, ``eval``: the last held-out evaluation's, at its step).

The pipeline's stage task sets the variable and turns the file into a Prefect progress artifact whose
description shows the latest metrics and eval metrics; run by hand, nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def report_progress(step: int, total: int, metrics: dict[str, float] | None = None, warning: str | None = None) -> None:
    """``metrics``: this step's scalars; those named ``eval_*`` (logged on evaluation steps) are kept until
    the next evaluation. ``warning``: what is wrong with this step, shown in the progress artifact."""
    target = os.environ.get("RLHF_PROGRESS_FILE")
    if not target:
        return
    path = Path(target)
    metrics = metrics or {}
    evals = {k: v for k, v in metrics.items() if k.startswith("eval_")}
    previous = _read(path) or {}
    record = {"step": step, "total": total, "metrics": {k: v for k, v in metrics.items() if k not in evals},
              "eval": {"step": step, **evals} if evals else previous.get("eval"), "warning": warning}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def _read(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


SHOWN = ("loss", "reward", "accuracy", "kl", "entropy", "margin")  # step metrics named in the summary, in this order


def read_progress(path: str | Path) -> tuple[float | None, str]:
    """(percent done, or None before the first step; one line for the progress artifact: the step, its main
    metrics and the latest eval metrics), from one read of the file."""
    p = _read(path)
    if not p or not p.get("total"):
        return None, ""
    metrics = p.get("metrics") or {}
    shown = sorted((k for k in metrics if any(s in k for s in SHOWN)), key=lambda k: min(i for i, s in enumerate(SHOWN) if s in k))
    text = f"step {p['step']}/{p['total']}" + "".join(f", {k} {metrics[k]:.4g}" for k in shown[:6])
    ev = dict(p.get("eval") or {})
    if ev:
        at = ev.pop("step")
        text += f"; eval at step {at}: " + ", ".join(f"{k.removeprefix('eval_')} {v:.4g}" for k, v in ev.items())
    if p.get("warning"):
        text += f"; WARNING: {p['warning']}"
    return 100.0 * p["step"] / p["total"], text
