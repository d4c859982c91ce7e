"""A stage's training curves in the Prefect UI: one markdown artifact per stage run, a plot (a PNG inside
the markdown as a ``data:`` URI, so the UI shows it without reaching any file) above a table of the key
metrics by step, updated in place while the stage runs and once more at its end.

The flow's task process draws it from the stage's own ``metrics.jsonl`` (written at ``logging_steps``),
so the training ranks do no extra work; :class:`Curves` redraws only when new steps were logged, and at
most every :data:`MIN_INTERVAL_S` (what that costs a stage: ``bench/curves.py``).

Metrics plotted: those whose name holds one of :data:`KINDS` (loss, reward, accuracy, kl, entropy,
length, margin), a panel per metric with its held-out ``eval_`` twin on the same axes; timings (``*_s``)
and spreads (``*_std``) are left to the log. A panel whose values span more than
:data:`~stages.common.plots.LOG_SPAN` uses a log scale.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.common.plots import y_scale

KINDS = ("loss", "reward", "accuracy", "kl", "entropy", "length", "margin")
MAX_PANELS = 8
MAX_ROWS = 20  # table rows: evenly spread over the log, the first and the last step always in
MIN_INTERVAL_S = 10.0  # the least time between two updates while the stage runs (the last one always comes)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` being written: a torn last line (mid-write) is left for the next read."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for ln in lines:
        try:
            row = json.loads(ln)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def panels(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """{panel title: the metric keys drawn in it}: a metric and its ``eval_`` twin share a panel; panels
    ordered by :data:`KINDS`, then by first appearance; at most :data:`MAX_PANELS`."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k != "step" and k not in keys and _number(row[k]) is not None]
    groups: dict[str, list[str]] = {}
    for k in keys:
        if k.endswith(("_s", "_std")):
            continue
        base = k.removeprefix("eval_")
        if any(kind in base for kind in KINDS):
            groups.setdefault(base, []).append(k)
    order = sorted(groups, key=lambda b: (min(i for i, kind in enumerate(KINDS) if kind in b), keys.index(groups[b][0])))
    return {b: sorted(groups[b], key=lambda k: k.startswith("eval_")) for b in order[:MAX_PANELS]}


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], _number(r.get(key))) for r in rows]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_png(rows: list[dict[str, Any]], groups: dict[str, list[str]], title: str, dpi: int = 72) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(groups))
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 2.6 * nrows), squeeze=False)
    for ax, (panel, keys) in zip(axes.flat, groups.items()):
        drawn: list[float] = []
        for k in keys:
            steps, values = series(rows, k)
            ax.plot(steps, values, marker="o" if len(steps) <= 20 else None, markersize=3,
                    label="held-out" if k.startswith("eval_") else "train")
            drawn += values
        scale = y_scale(drawn)
        ax.set_yscale(**scale)
        ax.set_title(panel + ("" if scale["value"] == "linear" else " (log scale)"), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _fmt(v: Any) -> str:
    x = _number(v)
    return "" if x is None else f"{x:.4g}"


def table(rows: list[dict[str, Any]], keys: list[str], max_rows: int = MAX_ROWS) -> str:
    """A markdown table (step, then ``keys``) of at most ``max_rows`` rows spread evenly over ``rows``."""
    if len(rows) > max_rows:
        idx = sorted({round(i * (len(rows) - 1) / (max_rows - 1)) for i in range(max_rows)})
        rows = [rows[i] for i in idx]
    head = "| step | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
    return head + "".join(f"| {r['step']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |\n" for r in rows)


def parse_table(markdown: str) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value)]} back from :func:`table`'s text inside ``markdown`` (what a reader of the
    artifact sees; the tests use it)."""
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    if not lines:
        return {}
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in header[1:]}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        for k, c in zip(header[1:], cells[1:]):
            if c:
                out[k].append((int(cells[0]), float(c)))
    return out


def markdown(name: str, stage: str, rows: list[dict[str, Any]], source: str, final: bool) -> str:
    """The artifact's text: heading, the plot as a data URI, the table, where the full log is."""
    groups = panels(rows)
    keys = [k for ks in groups.values() for k in ks]
    state = "finished" if final else "running"
    head = f"### {name} ({stage}): {len(rows)} logged steps, {state}\n\n"
    if not keys:
        return head + f"No plottable metrics logged yet (`{source}`).\n"
    png = plot_png(rows, groups, f"{name} ({stage})")
    shown = min(len(rows), MAX_ROWS)
    return (head + f"![{name} training curves]({data_uri(png)})\n\n" + table(rows, keys)
            + f"\n{shown} of {len(rows)} logged steps shown; every step: `{source}`\n")


def prefect_key(text: str) -> str:
    """``text`` as a Prefect artifact key: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def artifact_key(name: str) -> str:
    return prefect_key(f"{name}-curves")


class Curves:
    """The curves artifact of one stage run: created at the first update with plottable metrics, then
    updated in place (one artifact per stage run, its newest state; the key's history keeps earlier runs)."""

    def __init__(self, name: str, stage: str, metrics_path: str | Path | Callable[[], Path], min_interval_s: float | None = None):
        """``metrics_path``: the file, or a function giving it (a rerun's pending record, then the committed one)."""
        self.name, self.stage = name, stage
        self.where = metrics_path if callable(metrics_path) else (lambda: Path(metrics_path))
        self.key = artifact_key(name)
        self.min_interval_s = MIN_INTERVAL_S if min_interval_s is None else min_interval_s
        self.artifact_id = None
        self.rows_published = -1
        self.last = -math.inf
        self.seconds = 0.0  # spent drawing and publishing, in total (bench/curves.py reads it)
        self.updates = 0

    def update(self, final: bool = False) -> bool:
        """Redraw and publish if new steps were logged (and ``min_interval_s`` passed, unless ``final``)."""
        if not final and (self.min_interval_s == math.inf or time.monotonic() - self.last < self.min_interval_s):
            return False  # inf: only the last update
        path = self.where()
        rows = load_rows(path)
        if not rows or (len(rows) == self.rows_published and not final):
            return False
        t0 = time.perf_counter()
        text = markdown(self.name, self.stage, rows, str(path), final)
        description = f"{self.name} ({self.stage}): training curves, step {rows[-1]['step']}"
        self._publish(text, description)
        self.seconds += time.perf_counter() - t0
        self.updates += 1
        self.rows_published, self.last = len(rows), time.monotonic()
        return True

    def _publish(self, text: str, description: str) -> None:
        from prefect.artifacts import create_markdown_artifact
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        if self.artifact_id is None:
            self.artifact_id = create_markdown_artifact(markdown=text, key=self.key, description=description)
            return
        with get_client(sync_client=True) as client:
            client.update_artifact(self.artifact_id, ArtifactUpdate(data=text, description=description))
