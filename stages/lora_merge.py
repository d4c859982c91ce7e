"""LoRA merge: base + adapter -> a full checkpoint (causal LM or reward model).

The adapter's manifest names the digest of the base it was trained on; merging onto any other
checkpoint is refused before anything is loaded. The merged model (``peft``'s ``merge_and_unload``)
is saved in the base's dtype with the base's tokenizer; its kind is the base's (``full`` or
``reward``).

Run: ``python -m stages.lora_merge adapter=runs/sft-<key>/checkpoint base=runs/tiny_model-.../``
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field

from checkpoints import CheckpointError, CheckpointRef, commit, read_manifest, require_kind, staging, verify
from stages.common.config import StageConfig
from stages.common.stage import (
    ADAPTER,
    POLICY,
    REWARD,
    REWARD_ADAPTER,
    Input,
    StageRun,
    StageSpec,
    print_result,
)

STAGE = "lora_merge"


class LoraMergeConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")

    adapter: str = Field("", description="from the CLI; flows pass references")
    base: str = Field("", description="the model the adapter was trained on, from the CLI (default: the one the adapter's checkpoint names)")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")


def run_lora_merge(config: LoraMergeConfig, adapter: CheckpointRef, base: CheckpointRef | None, *,
                   run: StageRun | None = None) -> CheckpointRef:
    if base is None:
        raise CheckpointError("lora_merge: no base given (wire the base stage, or set base=<checkpoint folder>)")
    run = SPEC.identify(config, {"adapter": adapter, "base": base}, run)
    verify(adapter)
    verify(base)
    require_kind(adapter, ("adapter",), "the adapter to merge")
    require_kind(base, ("full",), "the base to merge onto")
    if adapter.base != base.digest:
        raise CheckpointError(
            f"{adapter.path}: adapter was trained on base {str(adapter.base)[:12]}, "
            f"but the given base {base.path} is {base.digest[:12]}; merge it onto the base it names"
        )
    manifest = read_manifest(adapter.path)
    head = manifest.stage == "reward_model"
    with run.claimed() as folder, staging(folder / "checkpoint") as tmp:
        dest = folder / "checkpoint"
        merge_to(adapter.path, base.path, tmp, reward=head, reward_stats=manifest.extra.get("reward_stats") or {})
        return commit(
            tmp, dest, stage=STAGE, kind="reward" if head else "full", config_hash=run.key, parent=adapter,
            extra={"base": base.digest},
        )


def merge_to(adapter_path: str, base_path: str, out: Path, reward: bool, reward_stats: dict) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from stages.common.vision import load_policy, tokenizer_or_processor

    if reward:
        model = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=1, dtype=torch.float32)
    else:
        model = load_policy(base_path)  # a vision-language model: its auto class, its processor saved below
    merged = PeftModel.from_pretrained(model, adapter_path).merge_and_unload()
    # the reward model's normalisation stats travel in the adapter's manifest
    merged.config.update({k: v for k, v in reward_stats.items() if k.startswith("reward_")})
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer_or_processor(base_path).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(
    STAGE, LoraMergeConfig, run_lora_merge,
    (Input("adapter", (ADAPTER, REWARD_ADAPTER), field="adapter", required=True), Input("base", (POLICY,), field="base")),
    # merging a reward model's adapter gives a reward model
    output=lambda config, inputs: REWARD if inputs.get("adapter") == REWARD_ADAPTER else POLICY,
)

if __name__ == "__main__":
    main()
