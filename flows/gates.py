"""Quality gates: conditions on the stages' metrics that a pipeline run must meet before its result counts.

A stage of a pipeline recipe may declare ``gates``, each ``<ref> <op> <number>`` or ``<ref> <op> <ref> [+|- <number>]``
(``op``: ``>=``, ``>``, ``<=``, ``<``), where a ``ref`` is ``<stage>.<metric>`` (a training stage: the last row of its
``metrics.jsonl``, which holds the final held-out metrics where the stage logs them, and the numbers of its
checkpoint manifest's ``extra``) or ``<eval stage>.<model>.<metric>`` (the eval report's). For example, on the RL
stage: ``rl.eval_accuracy >= sft.eval_accuracy + 0.05``; on the eval stage: ``eval.rl.accuracy >= eval.sft.accuracy``.

Gates are checked when every stage has run. A failing gate fails the flow run (:class:`GateFailed`, naming the
gate, the values and the threshold); checkpoints stay as they are. The pipeline's result (the checkpoint of the
last stage with gates; an eval gate's: the model it names) is named only when every gate passed.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stages.common.recipe import RecipeError

OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
REF = r"[a-z][\w-]*(?:\.[\w@/-]+){1,2}"
GATE = re.compile(rf"^\s*(?P<left>{REF})\s*(?P<op>>=|<=|>|<)\s*(?:(?P<right>{REF})\s*(?:(?P<sign>[+-])\s*(?P<offset>\d+(?:\.\d*)?(?:e-?\d+)?))?|(?P<number>-?\d+(?:\.\d*)?(?:e-?\d+)?))\s*$")


class GateFailed(RuntimeError):
    """A pipeline run's gate did not hold: its stages finished, their checkpoints stand, its result does not count."""


@dataclass(frozen=True)
class Gate:
    text: str
    owner: str  # the stage that declares it
    left: str
    op: str
    right: str | None  # another metric, or None: a fixed threshold
    offset: float  # added to the right metric, or the threshold itself

    def refs(self) -> list[str]:
        return [self.left] + ([self.right] if self.right else [])


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    value: float | None
    threshold: float | None
    passed: bool
    why: str  # what was compared, or what was missing

    def line(self) -> str:
        return f"{self.gate.text}: {self.why}"


def parse(text: str, owner: str, stages: Mapping[str, str]) -> Gate:
    """One gate of stage ``owner`` (``stages``: every stage's name -> its type), checked against the pipeline's
    stages: a RecipeError naming the gate otherwise."""
    m = GATE.match(text)
    if not m:
        raise RecipeError(f"gates: {text!r}: expected '<stage>.<metric> <op> <number>' or '<stage>.<metric> <op> "
                          "<stage>.<metric> [+|- <number>]' (op: >=, >, <=, <; an eval stage's metric: <eval>.<model>.<metric>)")
    right, number = m["right"], m["number"]
    offset = float(number) if number is not None else float(m["offset"] or 0) * (-1 if m["sign"] == "-" else 1)
    gate = Gate(text.strip(), owner, m["left"], m["op"], right, offset)
    for ref in gate.refs():
        stage, *rest = ref.split(".")
        if stage not in stages:
            raise RecipeError(f"gates: {text!r}: no stage named {stage!r} in the pipeline (its stages: {list(stages)})")
        if (stages[stage] == "eval") != (len(rest) == 2):
            form = "<eval>.<model>.<metric>" if stages[stage] == "eval" else "<stage>.<metric>"
            raise RecipeError(f"gates: {text!r}: {ref!r} should read {form} (stage {stage!r} is a {stages[stage]} stage)")
    return gate


def stage_metrics(out: Any, run_dir) -> dict[str, float]:
    """A finished stage's metrics as gates read them: an eval report's ``<model>.<metric>``; a training stage's last
    ``metrics.jsonl`` row and the numbers of its manifest's ``extra`` (nested ones by their own name too)."""
    from pathlib import Path

    from checkpoints import CheckpointRef, read_manifest
    from flows.curves import load_rows

    if not isinstance(out, CheckpointRef):  # an EvalReport
        return {f"{model}.{k}": float(v) for model, ms in out.metrics.items() for k, v in ms.items() if _number(v)}
    found: dict[str, float] = {}
    rows = load_rows(Path(run_dir) / "metrics.jsonl")
    if rows:
        found.update({k: float(v) for k, v in rows[-1].items() if _number(v) and k != "step"})
    for k, v in read_manifest(out.path).extra.items():
        if _number(v):
            found.setdefault(k, float(v))
        elif isinstance(v, dict):
            for kk, vv in v.items():
                if _number(vv):
                    found.setdefault(kk, float(vv))
    return found


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def evaluate(gates: list[Gate], metrics: Mapping[str, Mapping[str, float]]) -> list[GateResult]:
    """Every gate against ``metrics`` (stage name -> its :func:`stage_metrics`); a metric a stage does not have
    fails its gate, naming the metrics it has."""
    out = []
    for g in gates:
        values: dict[str, float] = {}
        missing = None
        for ref in g.refs():
            stage, metric = ref.split(".", 1)
            have = metrics.get(stage, {})
            if metric not in have:
                missing = f"stage {stage!r} has no metric {metric!r} (it has: {', '.join(sorted(have)) or 'none'})"
                break
            values[ref] = have[metric]
        if missing:
            out.append(GateResult(g, None, None, False, missing))
            continue
        value = values[g.left]
        threshold = values[g.right] + g.offset if g.right else g.offset
        passed = OPS[g.op](value, threshold)
        against = f"{g.right} {'+' if g.offset >= 0 else '-'} {abs(g.offset):g} = {threshold:.6g}" if g.right and g.offset else \
            f"{g.right} = {threshold:.6g}" if g.right else f"{threshold:g}"
        out.append(GateResult(g, value, threshold, passed, f"{g.left} = {value:.6g} {'' if passed else 'not '}{g.op} {against}"))
    return out


def result_stage(gates: list[Gate], order: list[str], types: Mapping[str, str]) -> str | None:
    """The stage whose checkpoint is the pipeline's result: the last stage (in run order) with gates; an eval stage's:
    the model its last gate's left side names."""
    owners = [s for s in order if any(g.owner == s for g in gates)]
    if not owners:
        return None
    last = owners[-1]
    if types[last] == "eval":
        return [g for g in gates if g.owner == last][-1].left.split(".")[1]
    return last


def report(results: list[GateResult]) -> str:
    """The gates as a markdown table (the run summary's)."""
    lines = ["| gate | stage | value | threshold | passed |", "|---|---|---|---|---|"]
    for r in results:
        value = "-" if r.value is None else f"{r.value:.6g}"
        threshold = "-" if r.threshold is None else f"{r.threshold:.6g}"
        lines.append(f"| `{r.gate.text}` | {r.gate.owner} | {value} | {threshold} | {'yes' if r.passed else '**no**: ' + r.why} |")
    return "\n".join(lines)


def check(results: list[GateResult]) -> None:
    failed = [r for r in results if not r.passed]
    if failed:
        raise GateFailed(f"{len(failed)} of {len(results)} gate(s) failed: " + "; ".join(
            f"stage {r.gate.owner!r}: {r.line()}" for r in failed) + " (the checkpoints stand; the run has no result)")
