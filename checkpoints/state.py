"""In-stage resume state: ``RUN_DIR/state/<tag>/`` folders and the manifest that makes one resumable.

A stage saves its resume state (DeepSpeed engine checkpoints, the RL driver's record and probe) into a
tag folder ``state/step<N>/`` and then calls :func:`commit_state`, which writes ``state/state.json``
last and atomically: the tag, the step, and the sha256 and size of every file of the tag folder. Only
a tag named there is ever resumed from, after :func:`resumable_state` has checked every file against
it, so a kill in the middle of a save resumes from the previous committed tag, and an altered, truncated
or missing file is refused by name instead of being unpickled. Older tag folders beyond ``keep_last``
are removed after the new manifest is in place.

DeepSpeed's own state files are torch pickles (its loader uses ``weights_only=False``); the manifest
limits what is loaded to files this project wrote, byte for byte. Hand-off checkpoints
(:mod:`checkpoints.store`) never hold pickles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from checkpoints.store import CheckpointError, sha256_file

STATE_MANIFEST = "state.json"
_TAG = re.compile(r"step(\d+)")


class StateManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tag: str
    step: int
    files: dict[str, str]  # path relative to the tag folder -> sha256
    sizes: dict[str, int]


def tag_of(step: int) -> str:
    return f"step{step}"


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def commit_state(state_dir: str | Path, step: int, keep_last: int = 1) -> StateManifest:
    """Make ``state_dir/step<step>/`` the state to resume from; keep the newest ``keep_last`` tag folders."""
    state_dir = Path(state_dir)
    tag = tag_of(step)
    folder = state_dir / tag
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no state was saved under this tag")
    files, sizes = {}, {}
    for p in _files(folder):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        rel = p.relative_to(folder).as_posix()
        files[rel], sizes[rel] = sha256_file(p), p.stat().st_size
    manifest = StateManifest(tag=tag, step=step, files=files, sizes=sizes)
    tmp = state_dir / f".{STATE_MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(manifest.model_dump_json(indent=1))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(state_dir / STATE_MANIFEST)
    tags = {int(m.group(1)): p for p in state_dir.iterdir() if p.is_dir() and (m := _TAG.fullmatch(p.name))}
    keep = {step, *sorted(s for s in tags if s <= step)[-max(keep_last, 1):]}
    for s, p in tags.items():  # older tags beyond keep_last, and any newer one a killed run left half-saved
        if s not in keep:
            shutil.rmtree(p, ignore_errors=True)
    return manifest


def resumable_state(state_dir: str | Path) -> StateManifest | None:
    """The committed state to resume from, every file verified; None when nothing was committed.

    Raises :class:`CheckpointError` naming the file for an empty or torn manifest and for a missing,
    truncated or altered state file."""
    state_dir = Path(state_dir)
    path = state_dir / STATE_MANIFEST
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        m = StateManifest.model_validate_json(text)
    except ValidationError as e:
        raise CheckpointError(f"{path}: unreadable resume manifest ({'empty file' if not text.strip() else e.errors()[0]['msg']}); "
                              f"remove {state_dir} to start the run over") from e
    folder = state_dir / m.tag
    for rel, sha in sorted(m.files.items()):
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: resume state file listed in {path} is missing")
        if p.stat().st_size != m.sizes[rel]:
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes, {path} says {m.sizes[rel]} (truncated or altered)")
        if sha256_file(p) != sha:
            raise CheckpointError(f"{p}: sha256 differs from {path} (resume state altered)")
    return m


def read_json_state(state_dir: str | Path, m: StateManifest, name: str) -> dict:
    """A JSON record inside a verified tag folder."""
    return json.loads((Path(state_dir) / m.tag / name).read_text())
