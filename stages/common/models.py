"""Resolving a model spec from a recipe into a verified checkpoint reference."""

from __future__ import annotations

from checkpoints import CheckpointRef, import_pretrained


def resolve_model(spec: str, output_root: str) -> CheckpointRef:
    """``tiny:<preset>`` builds the embedded tiny model; anything else is a checkpoint folder, an HF
    model folder or a hub id (imported into the store under a manifest)."""
    if spec.startswith("tiny:"):
        from stages.common.tiny import TinyModelConfig, run_tiny_model

        return run_tiny_model(TinyModelConfig(preset=spec.removeprefix("tiny:"), output_root=output_root))
    return import_pretrained(spec, output_root)
