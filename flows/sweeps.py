"""Sweeps: several variants of one or more stages from the same upstream stages, compared in one artifact.

A pipeline recipe's ``sweep`` names overrides as ``<stage>.<dotted key>``: a ``grid`` (every combination of the
values given for each key) or a list of ``variants`` (each a mapping of such keys to values)::

    sweep:
      grid:
        rl.algo.advantage_estimator: [group_norm, rloo, reinforce_baseline]
        rl.train.lr: [1.0e-5, 3.0e-5]

The plan runs every stage the sweep does not touch once, and for each variant a copy of each swept stage and of
every stage downstream of one (``rl-v0``, ``eval-v0``, ...) with the variant's overrides and its inputs rewired to
the variant's copies. Each copy is an ordinary stage with its own identity, so a shared stage trains once, a sweep
run again comes back Cached, and after one variant failed a rerun retrains that variant only. When the flow
ends, :func:`comparison` is one markdown artifact: every variant's overrides and final metrics (its swept stages'
last ``metrics.jsonl`` row and its eval reports) in a table, and the held-out curves of every variant on common
axes.

The comparison names the winner: ``sweep.select`` (``{metric: eval.rl.accuracy, mode: max}``; default: the left side
of the first gate, ``max``) ranks the variants, the table is sorted by it with the best marked, variants are labelled
by their overrides (``advantage_estimator=rloo``) in the table and the plot (a line style each), and the pipeline's
result is the selected variant's copy of the stage the metric belongs to (an eval metric's: the model it names).
The same table, plot and rows are written as ``comparison.md``, ``comparison.png`` and ``comparison.json`` under
``<output_root>/sweep-<pipeline name>/``. A variant whose stage failed is marked failed (its downstream stages are
skipped, the other variants run to the end); the flow fails after publishing, naming it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.common.recipe import RecipeError


class SelectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(description="<stage>.<metric> or <eval>.<model>.<metric>, in the recipe's own stage names (e.g. eval.rl.accuracy)")
    mode: Literal["max", "min"] = Field("max", description="max: the highest value wins; min: the lowest")


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grid: dict[str, list[Any]] = Field({}, description="<stage>.<dotted key> -> the values to try; every combination is a variant")
    variants: list[dict[str, Any]] = Field([], description="each a mapping <stage>.<dotted key> -> value (instead of grid)")
    max_concurrent: int = Field(1, ge=1, description="how many stages of the pipeline may run at once while it sweeps (each as its inputs finish); 1: one after the other")
    select: SelectConfig | None = Field(None, description="the metric that names the best variant (the pipeline's result); None: the first gate's left side, max")

    @model_validator(mode="after")
    def _one_form(self) -> SweepConfig:
        if bool(self.grid) == bool(self.variants):
            raise ValueError("sweep: give grid (every combination of values) or variants (a list), one of them")
        if any(not values for values in self.grid.values()):
            raise ValueError(f"sweep.grid: every key needs at least one value (got {self.grid})")
        return self

    def expanded(self) -> list[dict[str, Any]]:
        """Every variant as {<stage>.<key>: value}, in order."""
        if self.variants:
            return [dict(v) for v in self.variants]
        keys = list(self.grid)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(self.grid[k] for k in keys))]


def expand(stages: list, sweep: SweepConfig, source: str) -> tuple[list, list[dict[str, Any]]]:
    """``stages`` (StagePlans) with the swept stages and their downstream ones replaced by a copy per variant; and
    the variants: {"label", "overrides" ({stage: {key: value}}), "stages" ({original name: the copy's name})}."""
    names = [s.name for s in stages]
    variants = sweep.expanded()
    copied = _downstream(stages, _swept(variants, names, source))
    order = {n: i for i, n in enumerate(names)}
    placed = [(order[s.name], -1, s) for s in stages if s.name not in copied]  # every copy where its original was
    described = []
    for i, v in enumerate(variants):
        label = f"v{i}"
        rename = {n: f"{n}-{label}" for n in names if n in copied}
        overrides = _by_stage(v)
        placed += [(order[s.name], i, _copy(s, rename, overrides.get(s.name, {}))) for s in stages if s.name in copied]
        described.append({"label": label, "overrides": overrides, "stages": rename})
    return [s for *_, s in sorted(placed, key=lambda t: t[:2])], described


def _swept(variants: list[dict[str, Any]], names: list[str], source: str) -> set[str]:
    """The stages the variants' keys name (each key checked: <stage>.<dotted key> of a stage of the pipeline)."""
    swept: set[str] = set()
    for key in (k for v in variants for k in v):
        stage, _, field = key.partition(".")
        if stage not in names or not field:
            raise RecipeError(f"{source}: sweep key {key!r}: expected <stage>.<dotted key> with a stage of the pipeline "
                              f"(its stages: {names})")
        swept.add(stage)
    return swept


def _downstream(stages: list, swept: set[str]) -> set[str]:
    """``swept`` and every stage wired (directly or through others) to one of them: copied per variant."""
    copied = set(swept)
    for s in stages:
        if any(w in copied for v in s.inputs.values() for w in (v if isinstance(v, list) else [v])):
            copied.add(s.name)
    return copied


def _by_stage(variant: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{<stage>.<key>: value} as {stage: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in variant.items():
        stage, _, field = key.partition(".")
        out.setdefault(stage, {})[field] = value
    return out


def _copy(s, rename: dict[str, str], overrides: dict[str, Any]):
    """A variant's copy of stage ``s``: renamed, its inputs and gates rewired to the variant's copies, its overrides."""
    inputs = {k: ([rename.get(x, x) for x in w] if isinstance(w, list) else rename.get(w, w)) for k, w in s.inputs.items()}
    return s.model_copy(update={"name": rename[s.name], "inputs": inputs, "gates": [_renamed(g, rename) for g in s.gates],
                                "overrides": {**s.overrides, **overrides}})


def _renamed(gate: str, rename: dict[str, str]) -> str:
    import re

    return re.sub(r"\b([a-z][\w-]*)\.", lambda m: f"{rename.get(m[1], m[1])}.", gate)


def label(variant: dict[str, Any]) -> str:
    """A variant by its overrides, each key's last part: ``advantage_estimator=rloo, lr=3e-05``."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={val}" for kv in variant["overrides"].values() for k, val in kv.items())


def renamed_ref(ref: str, variant: dict[str, Any]) -> str:
    """A metric reference in the recipe's names (``eval.rl.accuracy``) as the variant's copies name it."""
    stage, *rest = ref.split(".")
    if len(rest) == 2:
        rest[0] = variant["stages"].get(rest[0], rest[0])
    return ".".join([variant["stages"].get(stage, stage), *rest])


def selection(sweep: SweepConfig, gates: list) -> SelectConfig | None:
    """``sweep.select``, else the first gate's left side (in the recipe's names), highest wins; None without either."""
    if sweep.select is not None:
        return sweep.select
    return SelectConfig(metric=gates[0].left) if gates else None


def result_of(select: SelectConfig, variant: dict[str, Any]) -> str:
    """The variant's stage that is the pipeline's result: the one the metric belongs to (an eval metric's: its model)."""
    stage, *rest = select.metric.split(".")
    original = rest[0] if len(rest) == 2 else stage
    return variant["stages"].get(original, original)


def comparison(variants: list[dict[str, Any]], outputs: dict[str, Any], runs: dict[str, Any], failed: dict[str, str] | None = None,
               select: SelectConfig | None = None, metric_of=None) -> dict[str, Any]:
    """The sweep's comparison: ``rows`` (per variant: label, overrides, status, the selection metric's value, each
    swept-or-downstream stage's final metrics and its eval reports' metrics), sorted best first (failed variants
    last), ``best`` (the winner's label, or None), ``curves`` (held-out accuracy per variant) and ``keys`` (the
    columns shown). ``metric_of(stage name) -> {metric: value}``: what gates read of a finished stage."""
    rows, curves = [], {}
    for v in variants:
        row, held = _variant_row(v, outputs, runs, failed or {})
        if select is not None and row["status"] == "ok" and metric_of is not None:
            stage, metric = renamed_ref(select.metric, v).split(".", 1)
            row["selected"] = metric_of(stage).get(metric)
        rows.append(row)
        curves.update({f"{row['label']} ({original})": points for original, points in held.items()})
    rows = _ranked(rows, select)
    best = rows[0]["variant"] if rows and rows[0].get("selected") is not None else None
    for r in rows:
        r["best"] = r["variant"] == best
    keys = sorted({k for r in rows for k in r} - {"variant", "label", "overrides", "status", "selected", "best"},
                  key=lambda k: (not _headline(k), k))[:12]
    return {"rows": rows, "best": best, "curves": curves, "keys": keys,
            "select": None if select is None else select.model_dump()}


def _ranked(rows: list[dict[str, Any]], select: SelectConfig | None) -> list[dict[str, Any]]:
    """The rows with a selection value, best first; then the others (the failed ones last)."""
    ranked = sorted((r for r in rows if r.get("selected") is not None), key=lambda r: r["selected"],
                    reverse=select is None or select.mode == "max")
    return ranked + sorted((r for r in rows if r.get("selected") is None), key=lambda r: r["status"] != "ok")


def _variant_row(v: dict[str, Any], outputs: dict[str, Any], runs: dict[str, Any], failed: dict[str, str]) -> tuple[dict, dict]:
    """One variant's row (status: ok, or which of its stages failed and why) and its held-out curves by stage."""
    row: dict[str, Any] = {"variant": v["label"], "label": label(v),
                           "overrides": ", ".join(f"{s}.{k}={val}" for s, kv in v["overrides"].items() for k, val in kv.items())}
    broken = [f"{name}: {failed[name]}" for name in v["stages"].values() if name in failed]
    row["status"] = "ok" if not broken else "failed (" + "; ".join(broken) + ")"
    held: dict[str, list] = {}
    for original, name in v["stages"].items():
        out = outputs.get(name)
        if out is None:
            continue
        if hasattr(out, "metrics") and not hasattr(out, "digest"):  # an eval report: {model label: {metric: value}}
            row.update(_report_cells(original, out.metrics, v["label"]))
            continue
        cells, points = _training_cells(original, runs[name].run_dir / "metrics.jsonl")
        row.update(cells)
        if points:
            held[original] = points
    return row, held


def _report_cells(original: str, metrics: dict[str, dict[str, Any]], variant: str) -> dict[str, Any]:
    """An eval report's numbers as ``<eval>.<model>.<metric>``, the models by their names in the recipe."""
    return {f"{original}.{model.replace('-' + variant, '')}.{k}": val for model, ms in metrics.items()
            for k, val in ms.items() if isinstance(val, int | float)}


def _training_cells(original: str, path: Path) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    """A training stage's last step's metrics (timings left out) as ``<stage>.<metric>``, and its held-out
    accuracy curve."""
    from flows.curves import load_rows

    logged = load_rows(path)
    steps = [r for r in logged if r.get("step", 0) > 0]
    last = steps[-1] if steps else {}
    cells = {f"{original}.{k}": val for k, val in last.items() if isinstance(val, int | float) and not k.endswith("_s") and k != "step"}
    return cells, [(r["step"], r[k]) for r in logged for k in r if k.startswith("eval_") and "accuracy" in k]


def markdown(comp: dict[str, Any], plot: str | None) -> str:
    """The comparison as a markdown table (best first, marked) and the plot (``plot``: its address)."""
    keys, select = comp["keys"], comp["select"]
    head = f"### Sweep: {len(comp['rows'])} variants"
    if select:
        head += f", ranked by `{select['metric']}` ({select['mode']})"
        head += f"; best: **{_row_of(comp, comp['best'])['label']}** ({comp['best']})" if comp["best"] else "; no variant has it"
    metric = [f"{select['metric']}"] if select else []
    lines = [head, "", "| variant | overrides | status | " + " | ".join(metric + keys) + " |", "|---|---|---|" + "---|" * (len(metric) + len(keys))]
    for r in comp["rows"]:
        name = f"**{r['label']}** (best, {r['variant']})" if r["best"] else f"{r['label']} ({r['variant']})"
        cells = ([_fmt(r.get("selected"))] if select else []) + [_fmt(r.get(k)) for k in keys]
        lines.append(f"| {name} | {r['overrides']} | {r['status']} | " + " | ".join(cells) + " |")
    if plot:
        lines += ["", f"![held-out curves]({plot})"]
    return "\n".join(lines) + "\n"


def _row_of(comp: dict[str, Any], variant: str) -> dict[str, Any]:
    return next(r for r in comp["rows"] if r["variant"] == variant)


def write_files(folder: Path, comp: dict[str, Any]) -> dict[str, str]:
    """``comparison.md`` (its plot beside it), ``comparison.png`` (when there are curves) and ``comparison.json`` in
    ``folder``; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "comparison.md", "json": folder / "comparison.json"}
    if comp["curves"]:
        paths["plot"] = folder / "comparison.png"
        paths["plot"].write_bytes(plot(comp["curves"]))
    paths["markdown"].write_text(markdown(comp, "comparison.png" if comp["curves"] else None))
    paths["json"].write_text(json.dumps({k: v for k, v in comp.items() if k != "curves"} | {"curves": comp["curves"]}, indent=1))
    return {k: str(v) for k, v in paths.items()}


def _headline(key: str) -> bool:
    return any(w in key for w in ("accuracy", "reward_mean", "eval_loss"))


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "x")


def plot(curves: dict[str, list[tuple[int, float]]]) -> bytes:
    """The held-out curves, a line style and marker per variant (equal curves stay visible)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=72)
    for i, (name, points) in enumerate(curves.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], label=name, alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
