"""Direct preference optimisation (DPO, IPO, conservative DPO) on DeepSpeed.

Log-probs are summed over response tokens (prompt masked) for the chosen and rejected sequences of
each pair, in one forward pass. The reference is a frozen copy of the starting policy, or a given
checkpoint. Two modes:

- reference forward every step (a second, optimizer-less DeepSpeed engine), OpenRLHF's way;
- ``precompute_ref_logps: true``: reference log-probs computed once before training, then no
  reference model in memory. Without a separate reference checkpoint this pass uses the policy itself
  before its first update (identical weights), so no second model is ever loaded.

Both give the same first-step loss (tested). Loss per pair from ``stages.common.preference_losses``,
plus ``nll_loss_coef`` times the chosen response's mean per-token NLL (RPO, Pang et al. 2024).
Metrics: loss, implicit rewards beta*(log pi - log ref) of chosen and rejected, reward accuracy, margin.

Run: ``python -m stages.dpo recipes/dpo/tiny.yaml base=runs/sft-<key>/checkpoint``
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, model_validator

from checkpoints import CheckpointRef, require_kind, verify
from datasets_prep.loading import DataConfig
from datasets_prep.preference import (
    collate_pairs,
    num_pairs,
    pair_inputs,
    pair_items_from_json,
    pairs_of,
    sequence_sums,
)
from stages.common.config import (
    PAIR_DATA_UNUSED,
    ClusterConfig,
    LoggingConfig,
    LoraConfig,
    StageConfig,
    TrainConfig,
    section_unused,
)
from stages.common.logprobs import token_logps
from stages.common.preference_losses import PolicyPair, dpo_loss
from stages.common.stage import ADAPTER, POLICY, Input, StageRun, StageSpec, print_result, trained_output
from stages.common.stage_run import (
    read_items,
    total_steps,
    train_and_commit,
    training_metrics,
)

STAGE = "dpo"


# the DPO losses take no per-pair margin
DPO_DATA_UNUSED = {**PAIR_DATA_UNUSED, "margin_key": "the DPO losses take no margin", "score_keys": "the DPO losses take no margin"}


class DPOConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")
    UNUSED: ClassVar[dict[str, str]] = {**section_unused("data", DPO_DATA_UNUSED), **section_unused("eval_data", DPO_DATA_UNUSED), "eval_data.packing": "held-out rows are not packed (data.packing packs the training rows)"}

    base: str = Field("tiny:tiny", description="the starting policy, from the CLI; flows pass the SFT checkpoint")
    reference: str | None = Field(None, description="from the CLI; None = a frozen copy of the starting policy")
    data: DataConfig = Field(description="the training preference pairs (prompt, chosen, rejected)")
    eval_data: DataConfig | None = Field(None, description="held-out pairs: eval_loss, eval_reward_accuracy, eval_chosen/rejected_reward, eval_reward_margin (per pair) every eval_steps and after the last step")
    eval_steps: int = Field(0, ge=0, description="0: only after the last step")
    loss: Literal["dpo", "ipo", "cdpo"] = Field("dpo", description="dpo (sigmoid), ipo (squared), cdpo (conservative DPO with label smoothing)")
    beta: float = Field(0.1, gt=0, description="the KL strength (DPO's beta)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO's epsilon: the assumed rate of flipped preference labels")
    nll_loss_coef: float = Field(0.0, ge=0, description="weight of an NLL term on the chosen responses (0: none)")
    precompute_ref_logps: bool = Field(False, description="the reference's log-probs once before training instead of a reference forward every step")
    train: TrainConfig = Field(TrainConfig(), description="DeepSpeed, batch, optimizer and schedule")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters instead of full training")
    logging: LoggingConfig = Field(LoggingConfig(), description="logging.wandb: {project, ...}")
    cluster: ClusterConfig = Field(ClusterConfig(), description="cluster.address: run the ranks on an existing Ray cluster")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")

    @model_validator(mode="after")
    def _check(self) -> DPOConfig:
        if self.beta <= 0:
            raise ValueError(f"beta: {self.beta} must be positive")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing: {self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing > 0 and self.loss != "cdpo":
            raise ValueError(f"label_smoothing: {self.label_smoothing} is only used by loss 'cdpo' (loss is '{self.loss}')")
        return self


def run_dpo(config: DPOConfig, policy: CheckpointRef, reference: CheckpointRef | None = None, *,
            run: StageRun | None = None) -> CheckpointRef:
    """Train ``policy`` against ``reference`` (default: the starting policy) on preference pairs."""
    run = SPEC.identify(config, {"policy": policy, "reference": reference}, run)
    verify(policy)
    require_kind(policy, ("full",), "the DPO policy")
    if reference is not None:
        verify(reference)
        require_kind(reference, ("full",), "the DPO reference model")
    items, eval_pairs, report = pair_inputs(config, policy.path, STAGE)
    return train_and_commit(
        run=run,
        config=config,
        items=items,
        job={
            "base_path": policy.path,
            "reference_path": reference.path if reference else None,
            "packed": config.data.packing,
            "eval_pairs": [vars(p) for p in eval_pairs],
        },
        kind="adapter" if config.lora.enabled else "full",
        parent=policy,
        base=policy if config.lora.enabled else None,
        extra={"data": vars(report)},
    )


def pair_logps(module, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed response log-probs of chosen [N] and rejected [N], and chosen token counts [N]."""
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
    logits = module(**inputs, use_cache=False).logits
    sums = sequence_sums(token_logps(logits, batch["input_ids"]), batch)
    counts = sequence_sums(torch.ones_like(batch["input_ids"], dtype=torch.float32), batch)
    n = batch["margin"].numel()
    return sums[:n], sums[n:], counts[:n]


def dpo_batch_loss(policy_out, ref_chosen, ref_rejected, config: DPOConfig):
    """Per-pair loss and metric sums, from the policy's and the reference's summed log-probs."""
    chosen, rejected, chosen_tokens = policy_out
    pair = PolicyPair(chosen, rejected, ref_chosen, ref_rejected, config.beta, config.label_smoothing)
    losses = dpo_loss(config.loss)(pair)
    if config.nll_loss_coef:
        losses = losses + config.nll_loss_coef * (-chosen / chosen_tokens)
    chosen_reward = (config.beta * (chosen - ref_chosen)).detach()
    rejected_reward = (config.beta * (rejected - ref_rejected)).detach()
    return losses.sum(), {
        "chosen_reward": chosen_reward.sum(),
        "rejected_reward": rejected_reward.sum(),
        "reward_accuracy": (chosen_reward > rejected_reward).float().sum(),
        "reward_margin": (chosen_reward - rejected_reward).sum(),
    }


def precompute_reference(module, items, micro: int, pad: int, rank: int, world_size: int) -> None:
    """Set every pair's ``ref_chosen`` / ``ref_rejected``, computed once; micro-batches shared over ranks.

    Every rank runs the same number of forward passes (ZeRO-3 gathers are collective): ranks short
    of a shard repeat their last chunk and discard the result.
    """
    import torch.distributed as dist

    from stages.common.trainer import device

    chunks = [items[i : i + micro] for i in range(0, len(items), micro)]
    rounds = -(-len(chunks) // world_size)
    pairs = pairs_of(items)
    index = {id(p): k for k, p in enumerate(pairs)}
    table = torch.zeros(len(pairs), 2, dtype=torch.float64)
    module.eval()
    with torch.no_grad():
        for r in range(rounds):
            c = r * world_size + rank
            chunk = chunks[min(c, len(chunks) - 1)]
            batch = {k: v.to(device()) for k, v in collate_pairs(chunk, pad).items()}
            chosen, rejected, _ = pair_logps(module, batch)
            if c < len(chunks):
                rows = [index[id(p)] for p in pairs_of(chunk)]
                table[rows, 0] = chosen.double().cpu()
                table[rows, 1] = rejected.double().cpu()
    if world_size > 1:
        dist.all_reduce(table)
    module.train()
    for k, p in enumerate(pairs):
        p.ref_chosen, p.ref_rejected = table[k, 0].item(), table[k, 1].item()


def train_rank(job: dict, rank: int, world_size: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common import trainer

    config = DPOConfig.model_validate(job["config"])
    trainer.init_distributed()
    items = pair_items_from_json(read_items(job), job["packed"])
    tokenizer = AutoTokenizer.from_pretrained(job["base_path"])
    pad = tokenizer.pad_token_id
    total = total_steps(config.train, len(items))
    eng = trainer.build_engine(
        job["base_path"], config.train, config.lora, total,
        lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, use_safetensors=True),
    )
    micro = config.train.micro_train_batch_size
    eval_items = pair_items_from_json(job.get("eval_pairs") or [], packed=False)
    ref_engine = None
    if config.precompute_ref_logps:
        if job["reference_path"]:
            ref_engine, keep = trainer.build_reference_engine(job["reference_path"], config.train)
            for group in (items, eval_items):
                if group:
                    precompute_reference(ref_engine, group, micro, pad, rank, world_size)
            del ref_engine, keep  # no reference model in memory while training
            ref_engine = None
        else:  # the policy has not been updated yet: its log-probs are the reference's
            for group in (items, eval_items):
                if group:
                    precompute_reference(eng.engine, group, micro, pad, rank, world_size)
    else:
        ref_engine, keep = trainer.build_reference_engine(job["reference_path"] or job["base_path"], config.train)

    def loss_fn(engine, batch):
        if ref_engine is None:
            ref_chosen, ref_rejected = batch["ref_chosen"], batch["ref_rejected"]
        else:
            with torch.no_grad():
                ref_chosen, ref_rejected, _ = pair_logps(ref_engine, batch)
        return dpo_batch_loss(pair_logps(engine, batch), ref_chosen, ref_rejected, config)

    def evaluate() -> dict[str, float]:
        sums: dict[str, float] = {}
        for i in range(0, len(eval_items), micro):
            batch = {k: v.to(trainer.device()) for k, v in collate_pairs(eval_items[i : i + micro], pad).items()}
            loss_sum, metric_sums = loss_fn(eng.engine, batch)
            for k, v in {"loss": loss_sum, **metric_sums}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return {k: v / len(eval_items) for k, v in sums.items()}

    history = trainer.fit(
        eng, items, lambda its: collate_pairs(its, pad), loss_fn, num_pairs, config.train, total,
        Path(job["run_dir"]), rank, world_size, evaluate=evaluate if eval_items else None, eval_steps=config.eval_steps,
        export=lambda folder: trainer.export_hf(eng, folder, tokenizer, rank),
    )
    trainer.export_hf(eng, Path(job["export_dir"]), tokenizer, rank)
    return {"final": history[-1] if history else {}, "first": history[0] if history else {}, "steps": total}


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(STAGE, DPOConfig, run_dpo,
                 (Input("policy", (POLICY,), field="base"), Input("reference", (POLICY,), field="reference")),
                 output=trained_output(POLICY, ADAPTER), files=("data.paths", "eval_data.paths"),
                 metrics=lambda config: training_metrics(config, ("chosen_reward", "rejected_reward", "reward_accuracy", "reward_margin")))

if __name__ == "__main__":
    main()
