"""Step progress for whoever runs a stage: ``{"step", "total"}`` written to ``$RLHF_PROGRESS_FILE``.

The pipeline's stage task sets the variable and turns the file into a Prefect progress artifact; run
by hand, nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def report_progress(step: int, total: int) -> None:
    target = os.environ.get("RLHF_PROGRESS_FILE")
    if not target:
        return
    path = Path(target)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "total": total}))
    tmp.replace(path)


def read_progress(path: str | Path) -> float | None:
    """Percent done, or None before the first step."""
    try:
        p = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return 100.0 * p["step"] / p["total"] if p.get("total") else None
