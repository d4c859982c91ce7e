"""Checkpoint hand-off between stages: atomic save, manifest, verified load."""

from checkpoints.hub import import_pretrained
from checkpoints.store import (
    CheckpointError,
    CheckpointRef,
    commit,
    load_ref,
    path_digest,
    read_manifest,
    remembered_hashes,
    require_kind,
    sha256_file,
    staging,
    verify,
)

__all__ = [
    "CheckpointError",
    "CheckpointRef",
    "commit",
    "import_pretrained",
    "load_ref",
    "path_digest",
    "read_manifest",
    "remembered_hashes",
    "require_kind",
    "sha256_file",
    "staging",
    "verify",
]
