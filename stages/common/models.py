"""Resolving a model spec from a recipe into a verified checkpoint reference."""

from __future__ import annotations

from pathlib import Path

from checkpoints import CheckpointRef, import_pretrained

LATEST = "latest:"


def resolve_model(spec: str, output_root: str) -> CheckpointRef:
    """``tiny:<preset>`` builds the embedded tiny model (``tiny:<preset>+tools``: with the tool task's tokenizer,
    ``TinyModelConfig.tools``); ``latest:<stage>`` is the most recently committed output
    of that stage under ``output_root`` (e.g. ``latest:sft``: no run hash to copy; the resolved checkpoint's digest
    is what enters the run identity), ``latest:<stage>@<another output root>`` the same under that root (verified
    by digest, used where it is: nothing copied); anything else is a checkpoint folder, an HF model folder or a hub
    id (imported into the store under a manifest)."""
    if spec.startswith("tiny:"):
        from stages.common.tiny import TinyModelConfig, run_tiny_model

        preset, plus, extra = spec.removeprefix("tiny:").partition("+")
        if plus and extra != "tools":
            raise ValueError(f"{spec}: expected tiny:<preset> or tiny:<preset>+tools")
        return run_tiny_model(TinyModelConfig(preset=preset, tools=bool(plus), output_root=output_root))
    if spec.startswith(LATEST):
        stage, _, root = spec.removeprefix(LATEST).partition("@")
        if root and not Path(root).expanduser().is_dir():
            from checkpoints import CheckpointError

            raise CheckpointError(f"{spec}: {Path(root).expanduser().resolve()} is not a folder (expected an output root "
                                  f"holding <stage>-<key>/checkpoint folders)")
        return latest_output(stage, str(Path(root).expanduser()) if root else output_root)
    return import_pretrained(spec, output_root)


def latest_output(stage: str, output_root: str) -> CheckpointRef:
    """The newest committed checkpoint of ``stage`` under ``output_root`` (``<stage>-<run key>/checkpoint``, by the
    time its manifest was written), verified."""
    from checkpoints import CheckpointError, load_ref, verify
    from checkpoints.store import MANIFEST

    root = Path(output_root)
    found = sorted(root.glob(f"{stage}-*/checkpoint/{MANIFEST}"), key=lambda p: p.stat().st_mtime_ns)
    if not found:
        seen = sorted({p.parent.parent.name.rsplit("-", 1)[0] for p in root.glob(f"*-*/checkpoint/{MANIFEST}")})
        raise CheckpointError(f"{LATEST}{stage}: no committed {stage} checkpoint under {root.resolve()} "
                              f"(stages with one there: {seen or 'none'})")
    ref = load_ref(found[-1].parent)
    verify(ref)
    return ref
