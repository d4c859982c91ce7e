"""One run's identity: the key that names its run folder and its Prefect cache entry (see ``stages.common.stage``).

Below the stage declarations on purpose: whatever builds a checkpoint under an identity (a stage, the
tiny-model factory that ``stages.common.models`` runs for a ``tiny:`` spec) imports this module, and this
module imports no stage and nothing that declares one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import modulefinder
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from checkpoints import CheckpointRef, load_ref, read_manifest, sha256_file
from checkpoints.store import CheckpointError, content_digest, sweep

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# settings that change how a run is watched or continued, not what it computes
NOT_IN_IDENTITY = ("train.resume", "train.progress_bar", "train.logging_steps", "train.keep_last", "train.timeout_s", "logging",
                   "cluster", "timeout_s", "ray.call_timeout_s", "ray.startup_timeout_s", "reward.timeout_s", "reward.retries", "reward.check_call",
                   "verify_sync", "sync_tolerance", "sync_min_prob",
                   # how the weights travel and where the engines keep them: the same numbers either way (tests/integration/test_rl.py)
                   "sync", "rollout.enforce_eager", "rollout.gpu_memory_utilization", "rollout.enable_sleep", "train.enable_sleep",
                   # a hub dataset's revision counts as the commit it resolves to (StageSpec.file_digests)
                   "data.revision", "eval_data.revision")
IDENTITY_FILE = "identity.json"
LOCK_FILE = ".lock"
# a run's record (its metrics and TensorBoard events) while it reruns a folder that holds a committed output
PENDING_RECORD = ".record.pending"
RECORD = ("metrics.jsonl", "tensorboard")


def record_dir(run_dir: Path) -> Path:
    """Where a run writes its metrics and TensorBoard events: the run folder, or, while the folder holds a committed
    checkpoint (a refresh), :data:`PENDING_RECORD` beside it, so the committed record keeps matching its checkpoint
    until the new output commits (:func:`commit_record`)."""
    pending = run_dir / PENDING_RECORD
    return pending if pending.is_dir() or (run_dir / "checkpoint").is_dir() else run_dir


def metrics_file(run_dir: Path) -> Path:
    """The metrics being written now (a pending record's while a refresh runs), else the committed ones (also once a
    first run committed its checkpoint: its record was written in place)."""
    pending = run_dir / PENDING_RECORD
    return (pending if pending.is_dir() else run_dir) / RECORD[0]


def commit_record(run_dir: Path) -> None:
    """After a rerun's output committed: its pending record replaces the folder's (each part by a rename)."""
    import shutil

    pending = run_dir / PENDING_RECORD
    if not pending.is_dir():
        return
    for name in RECORD:
        new, old = pending / name, run_dir / name
        if not new.exists():
            continue
        if new.is_dir():
            gone = run_dir / f".{name}.replaced"
            shutil.rmtree(gone, ignore_errors=True)
            if old.exists():
                os.replace(old, gone)
            os.replace(new, old)
            shutil.rmtree(gone, ignore_errors=True)
        else:
            os.replace(new, old)
    shutil.rmtree(pending, ignore_errors=True)


def canonical_config(config: BaseModel, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config as JSON, less where runs go (``output_root``), :data:`NOT_IN_IDENTITY` and the dotted
    fields ``drop`` (a stage's input fields: their checkpoints' digests count instead)."""
    data = config.model_dump(mode="json")
    for dotted in ("output_root", *NOT_IN_IDENTITY, *drop):
        *head, last = dotted.split(".")
        node = data
        for part in head:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return data


def make_run(stage: str, parts: dict[str, Any], output_root: str) -> StageRun:
    """The identity of a run of ``stage`` whose ``parts`` (config, inputs, files, code) are given."""
    blob = json.dumps({"stage": stage, **parts}, sort_keys=True, separators=(",", ":"))
    return StageRun(stage=stage, key=f"{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}",
                    output_root=str(output_root), parts=parts)


def committed_checkpoint(run: StageRun) -> CheckpointRef | None:
    """The checkpoint committed under ``run``'s identity, if its folder holds one that verifies."""
    dest = run.run_dir / "checkpoint"
    try:
        if read_manifest(dest).config_hash != run.key:
            return None
        return load_ref(dest)
    except CheckpointError:
        return None


class RunBusy(RuntimeError):
    """Another process holds the run folder's lock."""


class StageRun(BaseModel):
    """One run's identity (see the module docstring): its key names the run folder and the cache entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str
    key: str
    output_root: str
    parts: dict[str, Any]  # what the key hashes: config, inputs, files, code

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.key

    def prepare(self) -> Path:
        """Create the run folder; refuse one that another identity wrote (``identity.json``)."""
        folder = self.run_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / IDENTITY_FILE
        if path.is_file():
            try:
                found = json.loads(path.read_text()).get("key")
            except ValueError:
                found = None
            if found != self.key:
                raise CheckpointError(f"{folder}: holds a run of identity {found!r}, not {self.key!r}; "
                                      "its state and checkpoint are not this run's (remove the folder or use another output_root)")
            return folder
        tmp = folder / f".{IDENTITY_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"key": self.key, "stage": self.stage, **self.parts}, indent=1, sort_keys=True))
        tmp.replace(path)
        return folder

    @contextmanager
    def claimed(self) -> Iterator[Path]:
        """:meth:`prepare`, then hold the run folder's lock (``.lock``, an flock) for the block: a second
        process writing the same run (two flows, a flow and a CLI run) is refused, naming the holder."""
        import fcntl

        folder = self.prepare()
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunBusy(f"{folder}: another process (pid {holder}) is writing this run; wait for it to end or stop it") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            for stale in sweep(folder.parent):  # any run's save that died midway, under the same output root
                print(f"[{self.stage}] removed {stale} (a save whose writer is gone)", file=sys.stderr)
            yield folder
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def get_dotted(config: BaseModel | Mapping[str, Any] | None, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return node


@functools.cache
def import_closure(module: str, root: Path = PROJECT_ROOT) -> tuple[Path, ...]:
    """The project's source files that ``module`` imports, directly or through others (sorted)."""
    finder = modulefinder.ModuleFinder(path=[str(root)])  # modules outside the project are not followed
    finder.import_hook(module)
    if module not in finder.modules:
        raise ImportError(f"{module}: not a module under {root}")
    files = {Path(m.__file__).resolve() for m in finder.modules.values() if m.__file__}
    return tuple(sorted(f for f in files if f.is_relative_to(root.resolve())))


def plugin_files(source: str | Path) -> tuple[Path, ...]:
    """A user's code file (a reward function, an agent, a grader) and every module it imports, directly or through
    others, from its own folder tree or the project (``modulefinder``, as :func:`import_closure`: imports inside
    functions count; installed packages are not followed)."""
    src = Path(source).resolve()
    folder = src.parent
    finder = modulefinder.ModuleFinder(path=[str(folder), str(PROJECT_ROOT)])
    try:
        finder.run_script(str(src))
    except SyntaxError:  # the plugin's own import reports it, naming the file; its bytes still count
        return (src,)
    files = {src} | {Path(m.__file__).resolve() for m in finder.modules.values() if m.__file__}
    return tuple(sorted(f for f in files if f.suffix == ".py" and (f.is_relative_to(folder) or f.is_relative_to(PROJECT_ROOT.resolve()))))


def plugin_digest(source: str | Path) -> str:
    """sha256 over (path relative to the file's folder, contents) of :func:`plugin_files`: editing a helper module the
    file imports is a new identity; moving the folder elsewhere is not."""
    folder = Path(source).resolve().parent
    return content_digest({os.path.relpath(f, folder): sha256_file(f) for f in plugin_files(source)})


def code_version(modules: tuple[str, ...], root: Path | None = None) -> str:
    """sha256 over the (relative path, contents) of every project file the modules' import closure holds."""
    root = PROJECT_ROOT if root is None else root
    files = sorted({f for m in modules for f in import_closure(m, root)})
    return content_digest({f.relative_to(root.resolve()).as_posix(): sha256_file(f) for f in files})


