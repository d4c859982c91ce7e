"""What the project's plots share: a y scale that keeps small values visible beside large ones."""

from __future__ import annotations

from typing import Any

LOG_SPAN = 100.0  # a panel whose non-negative values span more than this (max / smallest positive) is drawn on a log scale


def y_scale(values: list[float]) -> dict[str, Any]:
    """Keyword arguments for ``Axes.set_yscale``: ``log`` when the values are positive and span more than
    :data:`LOG_SPAN`, ``symlog`` (linear below the smallest positive value) when zeros are among them,
    else ``linear``."""
    positive = [v for v in values if v > 0]
    if not positive or min(values) < 0 or max(positive) / min(positive) <= LOG_SPAN:
        return {"value": "linear"}
    if len(positive) == len(values):
        return {"value": "log"}
    return {"value": "symlog", "linthresh": min(positive)}
