"""Bring an outside model (a local Hugging Face folder or a hub id) into the checkpoint store.

A folder that already carries a manifest is verified and used as it is. Any other local folder, or a
hub repository fetched with ``huggingface_hub.snapshot_download``, is copied into the store under a
manifest (stage ``import``) so that later stages get the same verifiable reference either way; the
import's folder is named by the origin and the content digest, so an edited source is imported anew.
Only safetensors weights are taken; a model that ships only pickled weights is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

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
    else:
        from huggingface_hub import snapshot_download

        try:
            fetched = Path(snapshot_download(repo_id=str(name_or_path), allow_patterns=list(_ALLOW)))
        except Exception as e:  # offline, unknown repo, bad id: one message naming what was asked for
            raise CheckpointError(
                f"{name_or_path}: neither a local folder nor a reachable hub model ({type(e).__name__}: {e})"
            ) from e
        _check_model_folder(fetched)
        src, origin = fetched, f"hub:{name_or_path}"
    taken = [p for p in sorted(src.iterdir()) if p.is_file() and any(p.match(pat) for pat in _ALLOW)]
    # the import is named by where it came from and by what it holds: a folder edited in place is imported again
    content = content_digest({p.name: sha256_file(p) for p in taken})
    key = hashlib.sha256(f"{origin}\0{content}".encode()).hexdigest()[:12]
    dest = Path(store_root) / f"import-{src.name}-{key}"
    if (dest / MANIFEST).is_file():
        return load_ref(dest)
    with staging(dest) as tmp:
        for p in taken:
            shutil.copy2(p, tmp / p.name)
        kind = "reward" if _is_reward_config(tmp / "config.json") else "full"
        return commit(tmp, dest, stage="import", kind=kind, config_hash=key, extra={"origin": origin})


def _is_reward_config(config_path: Path) -> bool:
    archs = json.loads(config_path.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)
