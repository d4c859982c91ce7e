"""The checkpoint hand-off: the only code that writes or reads a checkpoint folder.

A checkpoint is a Hugging Face ``save_pretrained`` folder (safetensors only) plus ``manifest.json``,
which records the stage that made it, its kind (``full``, ``adapter``, ``reward``), its parent
checkpoint, the hash of the config that produced it and the sha256 of every file. A
:class:`CheckpointRef` is the small, serialisable handle stages pass to each other.

Saving is atomic: files are written into a hidden staging sibling (``.NAME.partial-PID-XXXX``),
fsynced, the manifest is written last, and only then is the folder renamed to its final name. A crash
at any point leaves no folder under the final name, so a folder that exists and has a manifest is
complete. Replacing an existing checkpoint swaps the two folders in one ``renameat2(RENAME_EXCHANGE)``
call, so the name always holds the old or the new checkpoint, never neither; where the file system
cannot exchange, the old folder is moved aside and put back by the next reader or writer if a crash
came between the two renames. Staging and moved-aside folders whose writer is gone are removed at the
next save under the same parent. Loading verifies every file against the manifest before anything
reads it.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
CheckpointKind = Literal["full", "adapter", "reward"]
# Files that may execute code when read; a checkpoint must never hold them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, incomplete, altered or of the wrong kind."""


class CheckpointRef(BaseModel):
    """A verifiable handle on a committed checkpoint folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    stage: str
    kind: CheckpointKind
    parent: str | None = None  # content digest of the checkpoint this one was trained from
    base: str | None = None  # for adapters: content digest of the full model they apply to
    config_hash: str
    digest: str  # sha256 over the manifest's (file, sha256) list


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = MANIFEST_VERSION
    stage: str
    kind: CheckpointKind
    parent: str | None
    base: str | None
    config_hash: str
    created: str
    files: dict[str, str]  # relative path -> sha256
    sizes: dict[str, int]
    digest: str
    extra: dict = {}


_REMEMBERED: ContextVar[dict | None] = ContextVar("remembered_file_hashes", default=None)


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's contents (``hashlib.file_digest``): the one file hash of the project.

    Inside :func:`remembered_hashes` a file's hash is remembered while its path, inode, size and
    modification and change times stay the same, so a flow run reads each file once. A file modified in
    the last two seconds is never remembered: file times are coarse, and a second same-size edit within
    one tick could look unchanged.
    """
    path = Path(path)
    memo = _REMEMBERED.get()
    if memo is None:
        return _read_sha256(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in memo:
        digest = _read_sha256(path)
        if time.time_ns() - st.st_mtime_ns <= 2_000_000_000:
            return digest
        memo[key] = digest
    return memo[key]


def _read_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextmanager
def remembered_hashes() -> Iterator[None]:
    """Within the block, :func:`sha256_file` hashes each unchanged file once (a flow run holds one)."""
    if _REMEMBERED.get() is not None:  # nested: the outer block's memory serves
        yield
        return
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def path_digest(path: str | Path) -> str:
    """:func:`content_digest` of a file (named ``""``) or of every file under a folder (relative names)."""
    path = Path(path)
    if path.is_file():
        return content_digest({"": sha256_file(path)})
    return content_digest({p.relative_to(path).as_posix(): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()})


def content_digest(files: dict[str, str]) -> str:
    """sha256 over the sorted (relative path, file sha256) pairs: identical content, identical digest."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _writer_alive(folder: Path) -> bool:
    """Whether the process named in a staging folder's name (``.NAME.partial-PID-XXXX``) still runs."""
    try:
        pid = int(folder.name.rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(dest: str | Path, clean: bool = True) -> None:
    """Undo what a crash during a save left beside ``dest``: put a moved-aside checkpoint back if the name
    is empty, and (``clean``) remove staging and moved-aside folders whose writer no longer runs."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return
    aside = sorted(dest.parent.glob(f".{dest.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not dest.exists():
        for old in reversed(aside):
            if not _writer_alive(old) and (old / MANIFEST).is_file():
                os.rename(old, dest)
                _fsync_dir(dest.parent)
                break
    if not clean:
        return
    for stale in [*dest.parent.glob(f".{dest.name}.partial-*"), *dest.parent.glob(f".{dest.name}.old-*")]:
        if stale.exists() and not _writer_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)


def sweep(root: str | Path) -> list[Path]:
    """Every run folder under ``root``: what a crash during a save left (:func:`recover` for each name with
    staging or moved-aside folders beside it), whoever wrote it; the folders removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    leftovers = [*root.glob("*/.*.partial-*"), *root.glob("*/.*.old-*")]
    for name in {(p.parent, p.name[1:].rsplit(".", 1)[0]) for p in leftovers}:
        recover(name[0] / name[1])
    return [p for p in leftovers if not p.exists()]


@contextmanager
def staging(dest: str | Path) -> Iterator[Path]:
    """Yield an empty hidden sibling of ``dest`` to write a checkpoint into.

    Use with :func:`commit`. If the body raises, the staging folder is removed; if the process
    dies, the leftover staging folder has no manifest and a name no reader looks up (the next
    save under the same name removes it).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _replace_folder(tmp: Path, dest: Path) -> None:
    """Put ``tmp`` under ``dest``; an existing ``dest`` stays loadable until the new folder is in place."""
    if not dest.exists():
        os.rename(tmp, dest)
    elif _exchange(tmp, dest):
        _fsync_dir(dest.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old checkpoint
    else:
        old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(dest, old)  # a crash here: recover() (in every reader and writer) moves it back
        os.rename(tmp, dest)
        _fsync_dir(dest.parent)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(dest.parent)


def commit(
    tmp: str | Path,
    dest: str | Path,
    *,
    stage: str,
    kind: CheckpointKind,
    config_hash: str,
    parent: CheckpointRef | None = None,
    base: CheckpointRef | None = None,
    extra: dict | None = None,
) -> CheckpointRef:
    """Digest, fsync and manifest the files in ``tmp``, then rename it to ``dest`` atomically.

    An existing ``dest`` is replaced only after the new folder is complete, in one atomic exchange
    where the file system has it: a reader never sees a half-written checkpoint, nor an empty name.
    """
    tmp, dest = Path(tmp), Path(dest)
    files: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for p in _listing(tmp):
        rel = p.relative_to(tmp).as_posix()
        if p.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(f"{p}: pickle-format file in a checkpoint; save with safetensors instead")
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        files[rel] = sha256_file(p)
        sizes[rel] = p.stat().st_size
    if not files:
        raise CheckpointError(f"{tmp}: nothing to commit (no files were written)")
    digest = content_digest(files)
    manifest = Manifest(
        stage=stage,
        kind=kind,
        parent=parent.digest if parent else None,
        base=base.digest if base else None,
        config_hash=config_hash,
        created=datetime.now(UTC).isoformat(),
        files=files,
        sizes=sizes,
        digest=digest,
        extra=extra or {},
    )
    mpath = tmp / MANIFEST
    with open(mpath, "w") as f:
        f.write(manifest.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    for d in {tmp, *(p.parent for p in _listing(tmp))}:
        _fsync_dir(d)
    _replace_folder(tmp, dest)
    return CheckpointRef(
        path=str(dest.resolve()),
        stage=stage,
        kind=kind,
        parent=manifest.parent,
        base=manifest.base,
        config_hash=config_hash,
        digest=digest,
    )


def read_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    if not path.exists():
        recover(path, clean=False)  # a replace interrupted between its two renames (no exchange on this file system)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint folder there")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; the folder is not a committed checkpoint (an interrupted save?)")
    try:
        return Manifest.model_validate_json(mpath.read_text())
    except ValueError as e:
        raise CheckpointError(f"{mpath}: unreadable manifest: {e}") from e


def verify(ref_or_path: CheckpointRef | str | Path) -> Manifest:
    """Recompute every file's sha256 and compare with the manifest (and the ref's digest, if given).

    Raises :class:`CheckpointError` naming the first missing, truncated, altered or unexpected file.
    """
    path = Path(ref_or_path.path if isinstance(ref_or_path, CheckpointRef) else ref_or_path)
    m = read_manifest(path)
    for rel, sha in sorted(m.files.items()):
        p = path / rel
        if p.suffix in PICKLE_SUFFIXES:  # a manifest can list one (written by hand): never load it
            raise CheckpointError(f"{p}: pickle-format file in a checkpoint (it could run code when loaded); "
                                  "hand-off checkpoints hold safetensors only")
        if not p.is_file():
            raise CheckpointError(f"{p}: file listed in the manifest is missing")
        size = p.stat().st_size
        if size != m.sizes.get(rel, size):
            raise CheckpointError(f"{p}: size {size} bytes, manifest says {m.sizes[rel]} (truncated or altered)")
        if sha256_file(p) != sha:
            raise CheckpointError(f"{p}: sha256 differs from the manifest (file altered)")
    for p in _listing(path):
        rel = p.relative_to(path).as_posix()
        if rel not in m.files:
            raise CheckpointError(f"{p}: file not in the manifest (added after the save)")
    if content_digest(m.files) != m.digest:
        raise CheckpointError(f"{path / MANIFEST}: digest does not match its file list")
    if isinstance(ref_or_path, CheckpointRef) and ref_or_path.digest != m.digest:
        raise CheckpointError(
            f"{path}: holds checkpoint {m.digest[:12]}, but the reference expects {ref_or_path.digest[:12]}"
        )
    return m


def load_ref(path: str | Path) -> CheckpointRef:
    """Verify the folder and return its reference."""
    path = Path(path)
    m = verify(path)
    return CheckpointRef(
        path=str(path.resolve()),
        stage=m.stage,
        kind=m.kind,
        parent=m.parent,
        base=m.base,
        config_hash=m.config_hash,
        digest=m.digest,
    )


def require_kind(ref: CheckpointRef, expected: tuple[str, ...], role: str) -> None:
    """Refuse a checkpoint of the wrong kind for a stage input (e.g. a reward model as a policy)."""
    if ref.kind not in expected:
        raise CheckpointError(
            f"{ref.path}: a '{ref.kind}' checkpoint (from stage '{ref.stage}') was given as {role}; "
            f"expected kind {' or '.join(repr(k) for k in expected)}"
        )
