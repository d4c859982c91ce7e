"""Bring an outside model (a local Hugging Face folder or a hub id) into the checkpoint store.

A folder that already carries a manifest is verified and used as it is. Any other local folder, or a
hub repository fetched with ``huggingface_hub.snapshot_download``, is copied into the store under a
manifest (stage ``import``) so that later stages get the same verifiable reference either way; the
import's folder is named by the origin and the content digest, so an edited source is imported anew.
Only safetensors weights are taken; a model that ships only pickled weights is refused.

A hub id is pinned: ``org/name`` (the default branch) or ``org/name@<branch|tag|commit>`` resolves to its
commit sha first (:func:`hub_commit`: from the hub, or offline from the local Hugging Face cache's ``refs``),
the snapshot is fetched at that commit, and the manifest records it (``origin: hub:org/name@<sha>``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Literal

from checkpoints.store import (
    MANIFEST,
    PICKLE_SUFFIXES,
    CheckpointError,
    CheckpointRef,
    commit,
    content_digest,
    load_ref,
    sha256_file,
    staging,
)

# What a model folder needs and may carry; everything else (pickles, READMEs, images) stays behind.
_ALLOW = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "*.model", "*.txt", "*.py")


def hub_cache() -> Path:
    """The Hugging Face hub cache as the environment says now (``HF_HUB_CACHE``, else huggingface_hub's default)."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether the hub is off limits (``HF_HUB_OFFLINE`` now, or when huggingface_hub was imported)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or bool(constants.HF_HUB_OFFLINE)


def hub_commit(repo_id: str, revision: str | None = None, repo_type: Literal["model", "dataset"] = "model") -> str:
    """The commit sha a hub id resolves to at ``revision`` (a branch, tag or commit; None: the default branch): a
    40-hex commit as given; else from the hub, or offline from the local Hugging Face cache's ``refs``. Neither: a
    :class:`CheckpointError` naming the id, the revision and where the cache was looked in."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    ref = hub_cache() / f"{repo_type}s--{repo_id.replace('/', '--')}" / "refs" / (revision or "main")
    reason = "offline (HF_HUB_OFFLINE=1)"
    if not hub_offline():
        try:
            from huggingface_hub import HfApi

            info = HfApi().dataset_info if repo_type == "dataset" else HfApi().model_info
            return info(repo_id, revision=revision).sha
        except Exception as e:  # noqa: BLE001  (unreachable, unknown, gated: the cache may still know it)
            reason = f"the hub did not answer ({type(e).__name__})"
    if ref.is_file():
        return ref.read_text().strip()
    pin = "the data section's revision to a commit sha" if repo_type == "dataset" else f"it as {repo_id}@<commit sha>"
    raise CheckpointError(f"{repo_id}: a hub {repo_type} id whose revision {revision or 'main'!r} can't be resolved to a "
                          f"commit: {reason} and not in the local Hugging Face cache (looked for {ref}); run once "
                          f"online, or pin {pin}")


def _check_model_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a model folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = f" (found only pickle weights: {', '.join(pickles)})" if pickles else ""
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}; convert the model to safetensors first")


def import_pretrained(name_or_path: str | Path, store_root: str | Path) -> CheckpointRef:
    """Return a verified reference for ``name_or_path``, importing it into ``store_root`` if needed."""
    src = Path(name_or_path)
    if src.is_dir() and (src / MANIFEST).is_file():
        return load_ref(src)
    if src.is_dir():
        _check_model_folder(src)
        origin = str(src.resolve())
    elif src.exists():
        raise CheckpointError(f"{src}: a file, not a model folder or hub id")
    elif str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise CheckpointError(f"{name_or_path}: no such model folder (looked for {src.resolve()})")
    else:
        src, origin = _fetch(str(name_or_path))
    return _stored(src, origin, Path(store_root))


def _stored(src: Path, origin: str, store_root: Path) -> CheckpointRef:
    """The import of model folder ``src`` (from ``origin``) under ``store_root``: committed once, then found."""
    taken = [p for p in sorted(src.iterdir()) if p.is_file() and any(p.match(pat) for pat in _ALLOW)]
    # the import is named by where it came from and by what it holds: a folder edited in place is imported again
    content = content_digest({p.name: sha256_file(p) for p in taken})
    key = hashlib.sha256(f"{origin}\0{content}".encode()).hexdigest()[:12]
    name = origin.removeprefix("hub:").partition("@")[0].rsplit("/", 1)[-1] if origin.startswith("hub:") else src.name
    dest = store_root / f"import-{name}-{key}"
    if (dest / MANIFEST).is_file():
        return load_ref(dest)
    with staging(dest) as tmp:
        for p in taken:
            shutil.copy2(p, tmp / p.name)
        kind = "reward" if _is_reward_config(tmp / "config.json") else "full"
        return commit(tmp, dest, stage="import", kind=kind, config_hash=key, extra={"origin": origin})


def _fetch(name: str) -> tuple[Path, str]:
    """A hub model (``org/name`` or ``org/name@<branch|tag|commit>``) fetched at the commit it resolves to: its
    snapshot folder and its origin ``hub:org/name@<sha>``."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = name.partition("@")
    sha = hub_commit(repo_id, revision or None)
    try:
        fetched = Path(snapshot_download(repo_id=repo_id, revision=sha, allow_patterns=list(_ALLOW),
                                         cache_dir=hub_cache(), local_files_only=hub_offline()))
    except Exception as e:  # gone from the cache, unreachable, bad id: one message naming what was asked for
        raise CheckpointError(f"{name}: the hub model at commit {sha} could not be fetched ({type(e).__name__}: {e})") from e
    _check_model_folder(fetched)
    return fetched, f"hub:{repo_id}@{sha}"


def _is_reward_config(config_path: Path) -> bool:
    archs = json.loads(config_path.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)
