"""The one Prefect task every stage runs as: cache key, isolation in a subprocess, progress artifact.

Cache key = stage type + canonical config + the content digests of the input checkpoints and of the
data files the config names + the stage's code version (:func:`flows.pipeline.code_version`). The task's result is the stage's
:class:`~checkpoints.CheckpointRef` (the eval stage: its :class:`~stages.eval.EvalReport`), persisted
by Prefect; :func:`cached_result_usable` is how the flow decides whether a cached one still stands.

The stage runs in a subprocess of its own (``stages.common.launcher``), so a crash, an OOM kill or a
Ray cluster of the stage cannot take the flow process with it; its traceback becomes the task's error,
and the launcher kills the subprocess's whole process group on failure, timeout or cancellation.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from checkpoints import CheckpointError, CheckpointRef, verify
from flows.pipeline import STAGES, code_version, digest_files
from stages.common.launcher import launch
from stages.common.progress import read_progress
from stages.common.stage_run import WATCH_SETTINGS
from stages.common.worker import load_target
from stages.eval import EvalReport

StageInputs = dict[str, CheckpointRef | list[CheckpointRef] | None]


def stage_cache_key(stage: str, config: dict[str, Any], inputs: StageInputs, labels: list[str] | None = None) -> str:
    cfg = json.loads(json.dumps(config))
    for k in WATCH_SETTINGS:
        (cfg.get("train") or {}).pop(k, None)
    digests = {k: ([r.digest for r in v] if isinstance(v, list) else v.digest if v else None) for k, v in sorted(inputs.items())}
    blob = json.dumps({"stage": stage, "config": cfg, "inputs": digests, "labels": labels, "code": code_version(stage),
                       "files": file_digests(cfg)}, sort_keys=True)
    return f"{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


def file_digests(config: Any) -> dict[str, str]:
    """sha256 of every local file (or folder of files) the config names: data paths, a reward function.

    The config holds paths, not contents: without this an edited dataset would come back Cached."""
    found: dict[str, str] = {}

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list):
            for v in value:
                visit(v)
        elif isinstance(value, str) and 0 < len(value) < 4096 and value != "." and value not in found:
            path = Path(value)
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
            if files:
                found[value] = digest_files([(f.relative_to(path).as_posix() if f != path else "", f) for f in files])

    visit(config.get("data"))
    visit(config.get("eval_data"))
    visit((config.get("reward") or {}).get("func"))
    return found


class StageCachePolicy(CachePolicy):
    """Prefect cache policy over :func:`stage_cache_key` (the task's own parameters)."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str:
        return stage_cache_key(inputs["stage"], inputs["config"], inputs["inputs"], inputs.get("labels"))


def result_usable(result: Any) -> bool:
    """A cached checkpoint counts only if it still verifies; a cached report only if its files exist."""
    if isinstance(result, CheckpointRef):
        try:
            verify(result)
            return True
        except (CheckpointError, OSError):
            return False
    if isinstance(result, EvalReport):
        return result.files_exist()
    return False


def cached_result_usable(key: str) -> bool:
    """False when a result is stored under ``key`` but no longer stands (checkpoint deleted or altered)."""
    from prefect.results import get_result_store

    store = get_result_store().update_for_task(run_stage)  # the store the task itself reads its cache from
    if not store.exists(key):
        return True  # nothing cached: the task runs anyway
    try:
        return result_usable(store.read(key).result)
    except Exception:  # an unreadable record counts as no cache
        return False


@task(cache_policy=StageCachePolicy(), persist_result=True, log_prints=True)
def run_stage(
    name: str, stage: str, config: dict[str, Any], inputs: StageInputs, labels: list[str] | None, run_root: str
) -> CheckpointRef | EvalReport:
    """Run one stage in a subprocess and return its output reference (``labels``: eval's model names)."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    key = stage_cache_key(stage, config, inputs, labels)
    run_dir = Path(run_root) / ".pipeline" / key
    progress_file = run_dir / "progress.json"
    progress_file.unlink(missing_ok=True)
    job = {
        "stage": stage,
        "config": config,
        "inputs": {k: ([r.model_dump() for r in v] if isinstance(v, list) else v.model_dump() if v else None) for k, v in inputs.items()},
        "labels": labels,
    }
    artifact = create_progress_artifact(0.0, description=f"{name} ({stage}): training steps done")
    done = threading.Event()

    def watch() -> None:
        last = 0.0
        while not done.wait(2.0):
            pct = read_progress(progress_file)
            if pct is not None and pct != last:
                update_progress_artifact(artifact, pct)
                last = pct

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = launch("flows.tasks:stage_job", job, 1, run_dir, env={"RLHF_PROGRESS_FILE": str(progress_file.resolve())})
    finally:
        done.set()
        watcher.join()
    update_progress_artifact(artifact, 100.0)
    result = EvalReport.model_validate(out["report"]) if "report" in out else CheckpointRef.model_validate(out["ref"])
    print(f"[{name}] {stage} -> {result.markdown if isinstance(result, EvalReport) else result.path}")
    return result


def stage_job(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target (in the stage's subprocess): rebuild config and refs, run the stage function."""
    import os

    from stages.common.models import resolve_model

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)  # this process is not a rank; the stage launches its own
    stype = STAGES[job["stage"]]
    config = load_target(stype.config).model_validate(job["config"])

    def ref(v: Any) -> Any:
        if v is None:
            return None
        return [CheckpointRef.model_validate(x) for x in v] if isinstance(v, list) else CheckpointRef.model_validate(v)

    given = {k: ref(v) for k, v in job["inputs"].items()}
    # inputs go in declaration order, positionally; a stage with a list input (eval: the models) takes
    # that list splatted and the others by name
    splat = any(inp.many for inp in stype.inputs)
    args: list[Any] = []
    kwargs: dict[str, Any] = {"labels": job["labels"]} if splat else {}
    for inp in stype.inputs:
        value = given.get(inp.name)
        if value is None and inp.fallback and getattr(config, inp.fallback, None):
            value = resolve_model(getattr(config, inp.fallback), config.output_root)
        if inp.many:
            args.extend(value or [])
        elif splat:
            kwargs[inp.name] = value
        else:
            args.append(value)
    result = load_target(stype.run)(config, *args, **kwargs)
    if isinstance(result, EvalReport):
        return {"report": result.model_dump()}
    return {"ref": result.model_dump()}
