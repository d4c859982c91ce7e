"""Supervised fine-tuning on DeepSpeed (ZeRO 0-3, bf16/fp32, LoRA, packing, N ranks).

Loss: token-level cross-entropy over response tokens (prompt masked; every token in pretrain mode),
summed over the global batch and divided by its number of target tokens, so the loss does not depend
on how the batch is split into micro-batches or ranks.

Run: ``python -m stages.sft recipes/sft/tiny.yaml train.world_size=2 train.zero_stage=3``
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict, Field

from checkpoints import CheckpointRef, require_kind, verify
from datasets_prep.loading import DataConfig
from datasets_prep.packing import PackedRow, loss_tokens, pack
from datasets_prep.packing import collate as collate_ids
from datasets_prep.sft import Example, prepare_sft
from stages.common.config import (
    SFT_DATA_UNUSED,
    ClusterConfig,
    LoggingConfig,
    LoraConfig,
    StageConfig,
    TrainConfig,
    section_unused,
)
from stages.common.logprobs import masked_sum, token_logps
from stages.common.stage import ADAPTER, POLICY, Input, StageRun, StageSpec, print_result, trained_output
from stages.common.stage_run import (
    check_data_fits,
    read_items,
    total_steps,
    train_and_commit,
    training_metrics,
)

STAGE = "sft"


class SFTConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")
    UNUSED: ClassVar[dict[str, str]] = {**section_unused("data", SFT_DATA_UNUSED), **section_unused("eval_data", SFT_DATA_UNUSED), "eval_data.packing": "held-out rows are not packed (data.packing packs the training rows)"}

    base: str = Field("tiny:tiny", description="Model to start from when run from the CLI: a checkpoint folder, an HF model folder, a hub id, or tiny:<preset> for the embedded tiny model. Flows pass the base checkpoint instead.")
    data: DataConfig = Field(description="the training rows (prompt/response pairs, chat messages or plain text)")
    eval_data: DataConfig | None = Field(None, description="held-out examples (OpenRLHF's eval_dataset): eval_loss (per target token) every eval_steps and at the end")
    eval_steps: int = Field(0, ge=0, description="0: only after the last step")
    train: TrainConfig = Field(TrainConfig(), description="DeepSpeed, batch, optimizer and schedule")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters instead of full training")
    logging: LoggingConfig = Field(LoggingConfig(), description="logging.wandb: {project, ...}")
    cluster: ClusterConfig = Field(ClusterConfig(), description="cluster.address: run the ranks on an existing Ray cluster")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")


def run_sft(config: SFTConfig, base: CheckpointRef, *, run: StageRun | None = None) -> CheckpointRef:
    """Train ``base`` on ``config.data``; returns the committed checkpoint (full model or adapter)."""
    from transformers import AutoTokenizer

    run = SPEC.identify(config, {"base": base}, run)
    verify(base)
    require_kind(base, ("full",), "the SFT base model")
    from stages.common.vision import is_vision

    tokenizer = AutoTokenizer.from_pretrained(base.path)
    processor = base.path if is_vision(base.path) else None
    examples, report = prepare_sft(config.data, tokenizer, processor)
    eval_examples = prepare_sft(config.eval_data, tokenizer, processor)[0] if config.eval_data else []
    items: list[Example] | list[PackedRow] = pack(examples, config.data.max_len) if config.data.packing else examples
    check_data_fits(config.train, len(items), config.data.paths)
    print(f"[sft] data: {report.summary()}" + (f"; packed into {len(items)} rows" if config.data.packing else ""))
    return train_and_commit(
        run=run,
        config=config,
        items=items,
        job={"base_path": base.path, "packed": config.data.packing, "eval_examples": [vars(e) for e in eval_examples]},
        kind="adapter" if config.lora.enabled else "full",
        parent=base,
        base=base if config.lora.enabled else None,
        extra={"data": vars(report)},
    )


def sft_loss(engine, batch):
    """Sum of next-token NLL over target tokens, and the number of those tokens."""
    from stages.common.vision import PIXEL_KEYS

    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask", *PIXEL_KEYS) if k in batch}
    logits = engine(**inputs, use_cache=False).logits
    logps = token_logps(logits, batch["input_ids"])
    return -masked_sum(logps, batch["loss_mask"]), {}


def train_rank(job: dict, rank: int, world_size: int) -> dict:
    """One rank's work (runs under ``stages.common.worker``)."""
    from transformers import AutoTokenizer

    from stages.common import trainer
    from stages.common.vision import load_policy, pixel_inputs, tokenizer_or_processor

    config = SFTConfig.model_validate(job["config"])
    trainer.init_distributed()
    cls = PackedRow if job["packed"] else Example
    items = [cls(**d) for d in read_items(job)]
    base_path = job["base_path"]
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    saved = tokenizer_or_processor(base_path)  # what goes beside the weights (a processor keeps its image settings)
    total = total_steps(config.train, len(items))
    eng = trainer.build_engine(base_path, config.train, config.lora, total, load_policy)

    def collate(chunk):  # rows with images: their pixel tensors too (packed rows have none: no packing with images)
        batch = collate_ids(chunk, tokenizer.pad_token_id)
        return {**batch, **pixel_inputs(base_path, [e.images for e in chunk])} if isinstance(chunk[0], Example) else batch

    run_dir = Path(job["run_dir"])
    eval_items = [Example(**d) for d in job.get("eval_examples") or []]

    def evaluate() -> dict[str, float]:
        nll, n = 0.0, 0
        for i in range(0, len(eval_items), config.train.micro_train_batch_size):
            chunk = eval_items[i : i + config.train.micro_train_batch_size]
            batch = {k: v.to(trainer.device()) for k, v in collate(chunk).items()}
            nll += sft_loss(eng.engine, batch)[0].item()
            n += sum(loss_tokens(e) for e in chunk)
        return {"loss": nll / n}

    history = trainer.fit(
        eng,
        items,
        collate,
        sft_loss,
        loss_tokens,
        config.train,
        total,
        run_dir,
        rank,
        world_size,
        evaluate=evaluate if eval_items else None,
        eval_steps=config.eval_steps,
        export=lambda folder: trainer.export_hf(eng, folder, saved, rank),
    )
    probe = collate(items[: config.train.micro_train_batch_size])
    logits = trainer.forward_logits(eng, probe)
    trainer.export_hf(eng, Path(job["export_dir"]), saved, rank)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({"logits": logits, **probe}, str(run_dir / "final_probe.safetensors"))
    return {"final": history[-1] if history else {}, "steps": total}


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(STAGE, SFTConfig, run_sft, (Input("base", (POLICY,), field="base"),),
                 output=trained_output(POLICY, ADAPTER), files=("data.paths", "eval_data.paths"), metrics=training_metrics)

if __name__ == "__main__":
    main()
