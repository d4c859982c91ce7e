"""The parent-process side of a training stage: run folder, launch the ranks, commit the output.

Every training stage (SFT, RM, DPO) validates and tokenizes its data in the caller's process, so bad
input fails before any rank starts, then calls :func:`train_and_commit`. The ranks write the model
into a staging folder; only a fully successful run is committed under ``RUN_DIR/checkpoint``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from checkpoints import CheckpointRef, commit, staging
from checkpoints.store import CheckpointKind
from stages.common.config import SaveBestConfig
from stages.common.identity import commit_record
from stages.common.launcher import launch
from stages.common.stage import Logged, StageRun, logged

# what trainer.fit logs at every step, beside the loss function's own metrics
FIT_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


def training_metrics(config: BaseModel, loss_metrics: tuple[str, ...] = (), held_out: tuple[str, ...] | None = None,
                     manifest: tuple[str, ...] = ()) -> Logged:
    """The metrics a training stage (SFT, RM, DPO) can be gated on: :data:`FIT_METRICS` and its loss function's
    (``loss_metrics``), with ``eval_data`` the held-out ones (``eval_`` + ``held_out``, default: the loss and
    ``loss_metrics``), the manifest's ``steps``, its data report's counts and its own numbers (``manifest``)."""
    from datasets_prep.sft import PrepReport

    names = [*FIT_METRICS, *loss_metrics, "step", "steps", *manifest,
             *(f.name for f in dataclasses.fields(PrepReport) if f.type in (int, "int"))]
    if getattr(config, "eval_data", None) is not None:
        names += [f"eval_{m}" for m in (("loss", *loss_metrics) if held_out is None else held_out)]
    if config.train.save_best is not None:
        names += ["value"]  # the manifest's best: {metric, mode, step, value}
    return logged(names)


def check_data_fits(train, num_items: int, paths: list[str]) -> None:
    """The global batch splits over ranks and micro-batches, and the data holds at least one batch."""
    from datasets_prep.packing import check_batch_sizes

    check_batch_sizes(train.train_batch_size, train.micro_train_batch_size, train.world_size, num_items, ", ".join(paths))


def total_steps(train, num_items: int) -> int:
    return train.max_steps or (num_items // train.train_batch_size) * train.num_epochs


def train_and_commit(
    *,
    run: StageRun,
    config: BaseModel,
    items: list[Any],
    job: dict[str, Any],
    kind: CheckpointKind,
    parent: CheckpointRef,
    base: CheckpointRef | None,
    extra: dict[str, Any],
) -> CheckpointRef:
    """Launch ``stages.<stage>:train_rank`` on ``config.train.world_size`` ranks and commit its output
    into the run's folder (named by its identity; in-stage state and metrics live there too)."""
    with run.claimed() as run_dir, staging(run_dir / "checkpoint") as tmp:
        items_path = run_dir / "items.json"
        items_path.write_text(json.dumps([dataclasses.asdict(it) for it in items]))
        full_job = {
            "config": config.model_dump(mode="json"),
            "items_path": str(items_path),
            "export_dir": str(tmp),
            "run_dir": str(run_dir),
            **job,
        }
        inputs = [parent.path, *([base.path] if base else []), *(v for k, v in job.items() if k.endswith("_path") and v)]
        result = launch(f"stages.{run.stage}:train_rank", full_job, config.train.world_size, run_dir, timeout_s=config.train.timeout_s,
                        cluster=getattr(config, "cluster", None), inputs=inputs)
        return commit_output(run_dir, tmp, config.train.save_best, dict(stage=run.stage, kind=kind, config_hash=run.key,
                                                                         parent=parent, base=base), {**extra, **result})


def commit_output(run_dir: Path, tmp: Path, save_best: SaveBestConfig | None, meta: dict[str, Any],
                  extra: dict[str, Any]) -> CheckpointRef:
    """Commit a training stage's output as ``run_dir/checkpoint``: the last step's weights (``tmp``), or with
    ``train.save_best`` the best step's (``run_dir/best``, the manifest's ``best`` saying which step and value) with
    the last step's committed beside it as ``checkpoint-last`` (the manifest's ``last`` is its digest)."""
    if save_best is None:
        ref = commit(tmp, run_dir / "checkpoint", **meta, extra=extra)
    else:
        best = _best(run_dir, save_best, extra)
        last = commit(tmp, run_dir / "checkpoint-last", **meta, extra={**extra, "last_step": True})
        ref = commit(run_dir / "best", run_dir / "checkpoint", **meta, extra={**extra, "best": best, "last": last.digest})
    commit_record(run_dir)  # a rerun's metrics and TensorBoard events replace the record of the output it replaced
    return ref


def _best(run_dir: Path, cfg: SaveBestConfig, result: dict) -> dict:
    """What ``train.save_best`` kept (the step, the metric's value), or an error naming the metric and what was logged."""
    record = run_dir / "best.json"
    if not record.is_file() or not (run_dir / "best").is_dir():
        logged = sorted(k for k in (result.get("final") or result.get("last_step") or {}) if k != "step")
        raise RuntimeError(f"train.save_best.metric: {cfg.metric!r} was never logged with a value, so no step was kept "
                           f"(the last step logged: {', '.join(logged)}; held-out metrics need eval_data)")
    return json.loads(record.read_text())


def read_items(job: dict) -> list[dict]:
    return json.loads(Path(job["items_path"]).read_text())
