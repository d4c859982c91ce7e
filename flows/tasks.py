"""The one Prefect task every stage runs as: cached by the run's identity, isolated in a subprocess.

The cache key is the stage run's :class:`~stages.common.stage.StageRun` key, computed once by the
flow; the same key names the run folder the stage writes into, so the Prefect cache, the folder and
in-stage resume agree by construction. The task's result is the stage's result (a
:class:`~checkpoints.CheckpointRef`; eval: its :class:`~stages.eval.EvalReport`), persisted by Prefect;
:func:`cached_result` is how the flow decides whether a cached one still stands (stored as JSON, never pickle: a
record in another format is ignored unread). When Prefect has
no entry but the run folder already holds a finished output of the same identity (a CLI run, a wiped
Prefect database), the task returns that instead of training again (``refresh`` skips this).

The stage runs in a subprocess of its own (``stages.common.launcher``), so a crash, an OOM kill or a
Ray cluster of the stage cannot take the flow process with it; its traceback becomes the task's error,
and the launcher kills the subprocess's whole process group on failure, timeout or cancellation.

While the stage runs, a thread of the task publishes its step progress (a progress artifact with the latest
metrics) and its training curves (:mod:`flows.curves`, from the stage's ``metrics.jsonl``); both get a
last update when the stage ends, also when it fails.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from checkpoints import CheckpointError, CheckpointRef, verify
from flows.console import StageConsole, verbose
from flows.curves import Curves
from stages import registry
from stages.common.identity import metrics_file
from stages.common.launcher import StageFailed, launch
from stages.common.progress import read_progress
from stages.common.stage import StageRun, warn_if_unchanged
from stages.eval import EvalReport


class StageError(RuntimeError):
    """A stage of the flow failed: one line naming the stage, the error and where its traceback is."""


def last_line(text: str) -> str:
    """The line that says what went wrong (a traceback's last non-empty line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


class StageCachePolicy(CachePolicy):
    """Prefect cache policy: the key of the task's ``run`` parameter (the stage run's identity)."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str:
        return inputs["run"].key


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


def cached_result(key: str, run_dir: Path) -> str:
    """What the result store holds under ``key``: ``none``, ``usable``, ``stale`` (a checkpoint deleted or altered,
    a report's files gone, an unreadable record), ``elsewhere`` (a usable output, but not in ``run_dir``: the same
    identity run under another output root, which identities leave out; the run is this root's, so its output is
    looked for, or made, here) or ``unsafe``: a record in another format than JSON (Prefect's pickle, e.g. a file
    dropped into the result storage). An unsafe record is never deserialized (loading a pickle runs whatever code it
    names; Prefect's own ``exists`` loads the whole record, so it is not asked): it is moved aside
    (``<key>.refused``) before the task could see it."""
    from prefect.results import get_result_store

    store = get_result_store().update_for_task(run_stage)  # the store the task itself reads its cache from
    raw = _raw_record(store, key)
    if raw is None:
        return "none"
    if record_format(raw) != "json":
        _set_aside(store, key)
        return "unsafe"
    try:
        result = store.read(key).result
    except Exception:  # an unreadable record counts as no cache
        return "stale"
    if not result_usable(result):
        return "stale"
    return "usable" if output_folder(result) == run_dir.resolve() else "elsewhere"


def output_folder(result: Any) -> Path | None:
    """The run folder a stage's result lives in (a checkpoint's: ``<run folder>/checkpoint``; a report's folder)."""
    if isinstance(result, CheckpointRef):
        return Path(result.path).resolve().parent
    if isinstance(result, EvalReport):
        return Path(result.folder).resolve()
    return None


def _storage(store):
    from prefect.results import get_default_result_storage

    return store.metadata_storage or store.result_storage or get_default_result_storage(_sync=True)


def _raw_record(store, key: str) -> bytes | None:
    """The stored record's bytes, not deserialized (None: nothing stored under ``key``)."""
    from prefect.utilities.asyncutils import run_coro_as_sync

    try:
        raw = _storage(store).read_path(key)
        return run_coro_as_sync(raw) if hasattr(raw, "__await__") else raw
    except (FileNotFoundError, ValueError, OSError):
        return None


def record_format(raw: bytes) -> str | None:
    """The serializer a record names in its metadata, read as plain JSON (None: not a JSON record at all)."""
    import json

    try:
        meta = json.loads(raw)
        meta = meta.get("metadata", meta)  # a record holds {"metadata", "result"}; separate metadata storage: the metadata
        return (meta.get("serializer") or {}).get("type")
    except Exception:  # noqa: BLE001  (not JSON: not ours)
        return None


def _set_aside(store, key: str) -> None:
    """Move an unsafe record out of the task's way (local result storage), keeping it for whoever looks into it."""
    import os

    path = getattr(_storage(store), "_resolve_path", lambda k: None)(key)
    if path is None or not os.path.isfile(path):
        raise RuntimeError(f"the cached result under {key} is not a JSON record and can't be moved aside in this result "
                           "storage; remove it before running again")
    os.replace(path, f"{path}.refused")


# results are JSON (a CheckpointRef or an EvalReport is plain data), never pickle: see cached_result
@task(cache_policy=StageCachePolicy(), persist_result=True, result_serializer="json", log_prints=True)
def run_stage(name: str, run: StageRun, config: dict[str, Any], inputs: dict[str, Any], reuse: bool = True,
              timeout_s: float | None = None) -> Any:
    """Run one stage in a subprocess (``inputs``: checkpoint refs, or {label: ref} for a list input); past
    ``timeout_s`` its process tree is ended and the task fails."""
    return execute_stage(name, run, config, inputs, reuse, timeout_s)


@task(cache_policy=StageCachePolicy(), persist_result=True, result_serializer="json", log_prints=True)
def run_stage_on_pool(name: str, run: StageRun, config: dict[str, Any], inputs: dict[str, Any], reuse: bool = True,
                      timeout_s: float | None = None, pool: str = "", job_variables: dict[str, Any] | None = None) -> Any:
    """The stage as a flow run of the deployment ``run-stage/<pool>`` (:mod:`flows.stage_flow`), which a worker of
    work pool ``pool`` picks up; this task waits for it (a subflow of this task run in the UI). The output is the
    checkpoint committed under the run's identity, so caching, retries and reruns are this task's, as in-process."""
    from prefect.deployments import run_deployment

    spec = registry.spec(run.stage)
    existing = _existing(name, run, spec) if reuse else None
    if existing is not None:
        return existing
    child = run_deployment(name=f"{STAGE_FLOW}/{pool}", timeout=None, job_variables=job_variables or {},
                           parameters={"name": name, "run": run.model_dump(), "config": config,
                                       "inputs": spec.dump_inputs(inputs), "reuse": reuse, "timeout_s": timeout_s})
    if not child.state.is_completed():
        raise StageError(f"stage {name!r} ({run.stage}) failed on work pool {pool!r} (flow run {child.name}, "
                         f"{child.state.name}): {last_line(child.state.message or '')}")
    result = spec.existing(run)
    if result is None:
        raise StageError(f"stage {name!r} ({run.stage}): flow run {child.name} on work pool {pool!r} completed but "
                         f"{run.run_dir} holds no output of this identity (does the pool's worker see the same output root?)")
    print(f"[{name}] {run.stage} ran on work pool {pool!r} (flow run {child.name}) -> {getattr(result, 'path', result)}")
    return result


STAGE_FLOW = "run-stage"  # flows.stage_flow's flow: one deployment of it per work pool, named after the pool


def execute_stage(name: str, run: StageRun, config: dict[str, Any], inputs: dict[str, Any], reuse: bool = True,
                  timeout_s: float | None = None) -> Any:
    """What a stage's task (or its flow run on a work pool) does: the output if its run folder already holds it,
    else the stage in a subprocess, its progress and curves published meanwhile."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    spec = registry.spec(run.stage)
    existing = _existing(name, run, spec) if reuse else None
    if existing is not None:  # its curves: the committed record's (not a killed refresh's beside it)
        _update_curves(Curves(name, run.stage, run.run_dir / "metrics.jsonl"), final=True)
        return existing
    curves = Curves(name, run.stage, lambda: metrics_file(run.run_dir))  # a refresh's pending record while it runs
    folder = run.prepare() / "task"
    progress_file = folder / "progress.json"
    progress_file.unlink(missing_ok=True)
    job = {"run": run.model_dump(), "config": config, "inputs": spec.dump_inputs(inputs)}
    title = f"{name} ({run.stage}): training steps done"
    artifact = create_progress_artifact(0.0, description=title)
    done = threading.Event()
    log = None if verbose() else folder / "stage.log"  # quiet: the stage's own output to its log file (flows.console)
    console = StageConsole(name, log) if log else None

    def publish(pct: float, summary: str) -> None:
        update_progress_artifact(artifact, pct, description=f"{title}; {summary}" if summary else title)

    def watch() -> None:
        last = (None, "")
        while not done.wait(2.0):
            now = read_progress(progress_file)
            if now[0] is not None and now != last:
                publish(*now)
                last = now
            if console is not None:
                console.update(*now)
            _update_curves(curves)

    # the task run's context travels with the thread: what it publishes belongs to this task and flow run
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True)
    watcher.start()
    try:
        out = launch("flows.tasks:stage_job", job, 1, folder, timeout_s=timeout_s,
                     env={"RLHF_PROGRESS_FILE": str(progress_file.resolve())}, output=log)
    except StageFailed as e:  # the stage's traceback once, in this task's log; the error itself is one line
        print(f"[{name}] {run.stage} failed:\n{e}" + (f"\n(its whole output: {log})" if log else ""))
        raise StageError(f"stage {name!r} ({run.stage}) failed: {last_line(str(e))} (its traceback is in the log above "
                         f"and in {folder}/rank0.error)") from None
    finally:
        done.set()
        watcher.join()
        if console is not None:
            console.update(*read_progress(progress_file))
            console.close()
        _update_curves(curves, final=True)  # a failed stage still shows what it logged
    publish(100.0, read_progress(progress_file)[1])
    result = spec.result.model_validate(out)
    print(f"[{name}] {run.stage} -> {result.markdown if isinstance(result, EvalReport) else result.path}")
    warn_if_unchanged(name, result, inputs, sys.stdout)  # in the task's log (its prints), where the flow's user looks
    return result


def _existing(name: str, run: StageRun, spec) -> Any:
    """The output the run folder already holds under this identity (a CLI run, an earlier attempt), said so; or None."""
    existing = spec.existing(run)
    if existing is not None:
        print(f"[{name}] {run.stage}: {run.run_dir} already holds this run's output (same identity); not rerun")
    return existing


def _update_curves(curves: Curves, final: bool = False) -> None:
    try:
        curves.update(final=final)
    except Exception as e:  # the UI's picture must never stop training
        print(f"[{curves.name}] training curves not published: {e!r}")


def stage_job(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target (in the stage's subprocess): the stage's function on its config and inputs."""
    import os

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)  # this process is not a rank; the stage launches its own
    run = StageRun.model_validate(job["run"])
    spec = registry.spec(run.stage)
    result = spec.run(spec.config.model_validate(job["config"]), **spec.load_inputs(job["inputs"]), run=run)
    return result.model_dump()
