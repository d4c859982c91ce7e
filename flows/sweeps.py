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
"""

from __future__ import annotations

import itertools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.common.recipe import RecipeError


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grid: dict[str, list[Any]] = Field({}, description="<stage>.<dotted key> -> the values to try; every combination is a variant")
    variants: list[dict[str, Any]] = Field([], description="each a mapping <stage>.<dotted key> -> value (instead of grid)")
    max_concurrent: int = Field(1, ge=1, description="how many stages of the pipeline may run at once while it sweeps (each as its inputs finish); 1: one after the other")

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
    swept: set[str] = set()
    for v in variants:
        for key in v:
            stage, _, field = key.partition(".")
            if stage not in names or not field:
                raise RecipeError(f"{source}: sweep key {key!r}: expected <stage>.<dotted key> with a stage of the pipeline "
                                  f"(its stages: {names})")
            swept.add(stage)
    copied = set(swept)
    for s in stages:  # downstream of a swept stage: copied per variant too
        wired = [x for v in s.inputs.values() for x in (v if isinstance(v, list) else [v])]
        if any(w in copied for w in wired):
            copied.add(s.name)
    order = {n: i for i, n in enumerate(names)}
    placed = [(order[s.name], -1, s) for s in stages if s.name not in copied]  # every copy where its original was
    described = []
    for i, v in enumerate(variants):
        label = f"v{i}"
        rename = {n: f"{n}-{label}" for n in names if n in copied}
        overrides: dict[str, dict[str, Any]] = {}
        for key, value in v.items():
            stage, _, field = key.partition(".")
            overrides.setdefault(stage, {})[field] = value
        for s in stages:
            if s.name not in copied:
                continue
            inputs = {k: ([rename.get(x, x) for x in w] if isinstance(w, list) else rename.get(w, w)) for k, w in s.inputs.items()}
            gates = [_renamed(g, rename) for g in s.gates]
            placed.append((order[s.name], i, s.model_copy(update={
                "name": rename[s.name], "inputs": inputs, "gates": gates,
                "overrides": {**s.overrides, **overrides.get(s.name, {})}})))
        described.append({"label": label, "overrides": overrides, "stages": rename})
    return [s for *_, s in sorted(placed, key=lambda t: t[:2])], described


def _renamed(gate: str, rename: dict[str, str]) -> str:
    import re

    return re.sub(r"\b([a-z][\w-]*)\.", lambda m: f"{rename.get(m[1], m[1])}.", gate)


def comparison(variants: list[dict[str, Any]], outputs: dict[str, Any], runs: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The sweep's comparison as markdown (a table, then the held-out curves of every variant on common axes) and its
    rows: per variant, its overrides, each swept-or-downstream stage's final metrics and its eval reports' metrics."""
    from flows.curves import data_uri, load_rows

    rows, curves = [], {}
    for v in variants:
        row: dict[str, Any] = {"variant": v["label"], "overrides": ", ".join(f"{s}.{k}={val}" for s, kv in v["overrides"].items()
                                                                                for k, val in kv.items())}
        for original, name in v["stages"].items():
            out = outputs.get(name)
            if out is None:
                continue
            if hasattr(out, "metrics") and not hasattr(out, "digest"):  # an eval report: {model label: {metric: value}}
                for model, ms in out.metrics.items():
                    for k, val in ms.items():
                        if isinstance(val, int | float):
                            row[f"{original}.{model.replace('-' + v['label'], '')}.{k}"] = val
                continue
            logged = load_rows(runs[name].run_dir / "metrics.jsonl")
            steps = [r for r in logged if r.get("step", 0) > 0]
            if steps:
                for k, val in steps[-1].items():
                    if isinstance(val, int | float) and not k.endswith("_s") and k != "step":
                        row[f"{original}.{k}"] = val
            held = [(r["step"], r[k]) for r in logged for k in r if k.startswith("eval_") and "accuracy" in k]
            if held:
                curves[f"{v['label']} {original}"] = held
        rows.append(row)
    keys = sorted({k for r in rows for k in r} - {"variant", "overrides"}, key=lambda k: (not _headline(k), k))[:12]
    lines = ["### Sweep: every variant", "", "| variant | overrides | " + " | ".join(keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['overrides']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |")
    if curves:
        lines += ["", f"![held-out curves]({data_uri(_plot(curves))})"]
    return "\n".join(lines) + "\n", rows


def _headline(key: str) -> bool:
    return any(w in key for w in ("accuracy", "reward_mean", "eval_loss"))


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _plot(curves: dict[str, list[tuple[int, float]]]) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=72)
    for name, points in curves.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
