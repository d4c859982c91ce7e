"""The ``nightly-recipe-validation`` flow: every recipe under ``recipes/`` parsed, validated, run small.

- Pipeline recipes (``recipes/pipelines/*.yaml``) are parsed and fully checked (every stage recipe,
  override and input), nothing run.
- Stage recipes (``recipes/<stage>/*.yaml``) are validated, then run at tiny scale: the stage's first
  input is the micro model (``tiny:micro``) and the recipe's ``validation.overrides`` shrink it. The
  per-step loss trajectory (``loss``; RL: the policy's ``entropy``, see ``LOSS_KEYS``) is compared with the pinned one
  (``<recipe>.trajectory.json`` beside it) step by step within ``|a - b| <= atol + rtol * |b|``, and the
  final metrics are gated by ``validation.min`` / ``validation.max``.

The recipe's ``validation:`` block (ignored by the stage itself)::

    validation:
      overrides: {train.max_steps: 4}
      rtol: 0.01
      atol: 0.001
      min: {reward_stats.eval_accuracy: 0.0}
      max: {final.loss: 7.0}

A table artifact lists each recipe with pass/fail and why; any failure fails the flow. Stages always
rerun here (a nightly run checks today's code and libraries, so nothing comes from the cache).

Run: ``python -m flows.nightly [--recipes recipes] [--only rl/] [--pin]`` (``--pin`` writes the trajectories instead)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from checkpoints import CheckpointRef, read_manifest
from flows.full_rlhf import run_plan
from flows.pipeline import PROJECT_ROOT, plan, plan_data
from stages import registry
from stages.common.recipe import RecipeError, load_config, read_recipe
from stages.eval import EvalReport

# the per-step metric whose trajectory is pinned (default: loss). RL at tiny scale starts from a random
# micro model whose rewards are all 0, so its policy loss is 0 at every step; its entropy is not
LOSS_KEYS = {"rl": "entropy"}
SKIP_STAGES = {"tiny_model", "lora_merge"}  # recipes of these are validated, not run


def find_recipes(recipes_dir: Path) -> list[tuple[Path, str]]:
    """(path, kind) for every recipe: kind ``pipeline`` or a stage name; other YAML is listed as unknown."""
    out = []
    for path in sorted(recipes_dir.rglob("*.yaml")):
        folder = path.parent.name
        out.append((path, "pipeline" if folder == "pipelines" else folder if folder in registry.STAGES else "unknown"))
    return out


def trajectory_path(recipe: Path) -> Path:
    return recipe.with_suffix(".trajectory.json")


def small_plan(recipe: Path, stage: str, validation: dict[str, Any], output_root: str):
    """A two-stage plan: the micro model, then the recipe's stage on it with the validation overrides."""
    spec = registry.spec(stage)
    first = spec.inputs[0]
    wire = {first.name: ["base"] if first.many else "base"}
    overrides = dict(validation.get("overrides") or {})
    if "train" in spec.config.model_fields:
        overrides = {"train.progress_bar": False, **overrides}
    data = {
        "name": f"nightly-{recipe.stem}",
        "output_root": output_root,
        "stages": [
            {"name": "base", "stage": "tiny_model", "overrides": {"preset": "micro"}},
            {"name": "recipe", "stage": stage, "recipe": str(recipe), "inputs": wire, "overrides": overrides},
        ],
    }
    return plan_data(data, str(recipe))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def outcome(result: CheckpointRef | EvalReport, stage: str) -> tuple[list[float], dict[str, float]]:
    """The per-step loss trajectory and the final metrics of a stage's output."""
    if isinstance(result, EvalReport):
        return [], flatten(result.metrics)
    run_dir = Path(result.path).parent
    key = LOSS_KEYS.get(stage, "loss")
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    extra = {k: v for k, v in read_manifest(result.path).extra.items() if k != "data"}
    return [float(ln[key]) for ln in lines if key in ln], flatten(extra)


def check(trajectory: list[float], metrics: dict[str, float], pinned: list[float] | None, validation: dict[str, Any]) -> list[str]:
    """Reasons the run fails its recipe's validation (empty: it passes)."""
    why = []
    if pinned is not None:
        rtol, atol = float(validation.get("rtol", 0.01)), float(validation.get("atol", 1e-3))
        if len(trajectory) != len(pinned):
            why.append(f"trajectory has {len(trajectory)} steps, pinned {len(pinned)}")
        for step, (a, b) in enumerate(zip(trajectory, pinned, strict=False), start=1):
            if not math.isfinite(a) or abs(a - b) > atol + rtol * abs(b):
                why.append(f"step {step}: loss {a:.6g} vs pinned {b:.6g} (tolerance {atol:g} + {rtol:g}*|pinned|)")
                break
    for bound, ok in (("min", lambda v, t: v >= t), ("max", lambda v, t: v <= t)):
        for name, limit in (validation.get(bound) or {}).items():
            if name not in metrics:
                why.append(f"{bound} {name}: no such metric (have: {', '.join(sorted(metrics)[:12])} ...)")
            elif not ok(metrics[name], float(limit)):
                why.append(f"{name} = {metrics[name]:.4g}, expected {'>=' if bound == 'min' else '<='} {limit}")
    return why


def validate_recipe(path: Path, kind: str, output_root: str, pin: bool) -> tuple[list[str], str]:
    """One recipe's validation: (why it failed, empty when it passed; what was checked). A pipeline is planned, a
    tiny_model or lora_merge recipe validated, any other stage's run at micro scale and its trajectory compared
    with the pinned one (``pin``: written as the new pin)."""
    if kind == "unknown":
        raise RecipeError(f"{path}: not under recipes/pipelines or recipes/<stage> for a known stage ({sorted(registry.STAGES)})")
    if kind == "pipeline":
        return [], f"validated ({len(plan(path).stages)} stages)"
    if kind in SKIP_STAGES:  # no micro-scale run: a tiny_model recipe has no input, lora_merge needs an adapter
        load_config(registry.spec(kind).config, [str(path)])
        return [], "validated"
    _, validation = read_recipe(path)
    p = small_plan(path, kind, validation, output_root)  # validates the recipe with its overrides
    result = run_plan(p, refresh=True)["recipe"]
    trajectory, metrics = outcome(result, kind)
    pinned_file = trajectory_path(path)
    if pin:
        if trajectory:
            pinned_file.write_text(json.dumps({"loss_key": LOSS_KEYS.get(kind, "loss"), "trajectory": trajectory}, indent=1) + "\n")
        return [], f"pinned {len(trajectory)} steps" if trajectory else "nothing to pin"
    pinned = json.loads(pinned_file.read_text())["trajectory"] if pinned_file.is_file() else None
    why = check(trajectory, metrics, pinned, validation)
    if trajectory and pinned is None:
        why.append(f"no pinned trajectory ({pinned_file.name}); run python -m flows.nightly --pin")
    return why, f"{len(trajectory)} steps within tolerance" if trajectory else "thresholds met"


@flow(name="nightly-recipe-validation", log_prints=True)
def nightly_recipe_validation(
    recipes_dir: str = "recipes", output_root: str = "runs/nightly", pin: bool = False, only: list[str] | None = None
) -> list[dict[str, str]]:
    """Validate every recipe under ``recipes_dir`` (``only``: those whose path contains one of these)."""
    folder = Path(recipes_dir)
    if not folder.is_absolute() and not folder.exists():
        folder = PROJECT_ROOT / folder
    rows: list[dict[str, str]] = []
    for path, kind in find_recipes(folder):
        if only and not any(o in str(path) for o in only):
            continue
        row = {"recipe": str(path.relative_to(folder.parent)), "kind": kind, "result": "pass", "why": ""}
        rows.append(row)
        try:
            failures, row["why"] = validate_recipe(path, kind, output_root, pin)
            if failures:
                row.update(result="FAIL", why="; ".join(failures))
        except Exception as e:  # one bad recipe fails its row, the others still run
            row.update(result="FAIL", why=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
    create_table_artifact(rows, key="nightly-recipe-validation", description="each recipe: pass/fail and why")
    for r in rows:
        print(f"{r['result']:4}  {r['recipe']}: {r['why']}")
    failed = [r for r in rows if r["result"] != "pass"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} recipes failed validation: "
                           + "; ".join(f"{r['recipe']}: {r['why']}" for r in failed))
    return rows


def main(argv: list[str] | None = None) -> None:
    import argparse
    import os

    ap = argparse.ArgumentParser(prog="python -m flows.nightly", description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="recipes")
    ap.add_argument("--output-root", default="runs/nightly")
    ap.add_argument("--pin", action="store_true", help="write each recipe's trajectory as the new reference")
    ap.add_argument("--only", action="append", default=None, help="only recipes whose path contains this (repeatable)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks (also RLHF_DEBUG=1)")
    args = ap.parse_args(argv)
    os.chdir(PROJECT_ROOT)
    from stages.common.cli import one_line_errors, take_debug

    with one_line_errors("python -m flows.nightly", args.debug or take_debug([])):
        nightly_recipe_validation(args.recipes, args.output_root, args.pin, args.only)


if __name__ == "__main__":
    main()
