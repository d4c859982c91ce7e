"""Reward model: a causal-LM backbone with a scalar head ``score``, trained on preference pairs.

The model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` (for Llama,
``LlamaForSequenceClassification``: the backbone under ``.model``, a bias-free linear ``score``), so
the saved folder loads in any tool with no newly initialised weights. The score of a sequence is
the head's output at its last token (for padded batches: the last non-padding token; left and right
padding give the same score because position ids follow the attention mask). Chosen and rejected
sequences go through one forward pass.

Losses (``stages.common.preference_losses``): ``sigmoid`` -log sigmoid(r_w - r_l - margin) and
``logexp``. After training, the mean and std of the rewards on the eval pairs are stored in the
checkpoint (``config.json``: ``reward_mean``, ``reward_std``; and the manifest) for RL to normalise.

Run: ``python -m stages.reward_model recipes/reward_model/tiny.yaml``
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import ConfigDict, Field

from checkpoints import CheckpointRef, require_kind, verify
from datasets_prep.loading import DataConfig
from datasets_prep.preference import (
    PairExample,
    collate_pairs,
    num_pairs,
    pair_inputs,
    pair_items_from_json,
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
from stages.common.preference_losses import RewardPair, reward_loss
from stages.common.scoring import score_padded, sequence_scores  # noqa: F401  (score_padded: this stage's scorer)
from stages.common.stage import (
    POLICY,
    REWARD,
    REWARD_ADAPTER,
    Input,
    StageRun,
    StageSpec,
    print_result,
    trained_output,
)
from stages.common.stage_run import (
    read_items,
    total_steps,
    train_and_commit,
    training_metrics,
)

STAGE = "reward_model"


class RewardModelConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")
    UNUSED: ClassVar[dict[str, str]] = {**section_unused("data", PAIR_DATA_UNUSED), **section_unused("eval_data", PAIR_DATA_UNUSED), "eval_data.packing": "held-out rows are not packed (data.packing packs the training rows)"}

    base: str = Field("tiny:tiny", description="from the CLI; flows pass the starting checkpoint (usually the SFT output)")
    data: DataConfig = Field(description="the training preference pairs (prompt, chosen, rejected)")
    eval_data: DataConfig | None = Field(None, description="held-out pairs: eval accuracy and loss every eval_steps and after the last step")
    loss: Literal["sigmoid", "logexp"] = Field("sigmoid", description="sigmoid: -log sigmoid(r_chosen - r_rejected - margin); logexp: log(1 + exp(r_rejected - r_chosen))")
    eval_steps: int = Field(50, ge=0, description="evaluate on eval_data every N steps (0: after the last step only)")
    train: TrainConfig = Field(TrainConfig(), description="DeepSpeed, batch, optimizer and schedule")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters (with the score head trained in full) instead of full training")
    logging: LoggingConfig = Field(LoggingConfig(), description="logging.wandb: {project, ...}")
    cluster: ClusterConfig = Field(ClusterConfig(), description="cluster.address: run the ranks on an existing Ray cluster")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")


def run_reward_model(config: RewardModelConfig, base: CheckpointRef, *, run: StageRun | None = None) -> CheckpointRef:
    """Train a reward model from ``base`` (a causal LM); returns a ``reward`` (or ``adapter``) checkpoint."""
    run = SPEC.identify(config, {"base": base}, run)
    verify(base)
    require_kind(base, ("full",), "the reward model's starting model")
    reward_loss(config.loss)
    items, eval_pairs, report = pair_inputs(config, base.path, STAGE)
    return train_and_commit(
        run=run,
        config=config,
        items=items,
        job={"base_path": base.path, "packed": config.data.packing, "eval_pairs": [vars(p) for p in eval_pairs]},
        kind="adapter" if config.lora.enabled else "reward",
        parent=base,
        base=base if config.lora.enabled else None,
        extra={"data": vars(report)},
    )


def pair_rewards(module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    scores = sequence_scores(module, batch)
    n = batch["margin"].numel()
    return scores[:n], scores[n:]


def load_reward_backbone(path: str):
    """A causal-LM (or reward) folder as a 1-label sequence classifier; `score` is new for a causal LM."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(path)
    if cfg.pad_token_id is None:
        raise ValueError(f"{path}: config has no pad_token_id; the reward model needs one to find the last token")
    return AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, use_safetensors=True
    )


def train_rank(job: dict, rank: int, world_size: int) -> dict:
    from transformers import AutoTokenizer

    from stages.common import trainer

    config = RewardModelConfig.model_validate(job["config"])
    trainer.init_distributed()
    items = pair_items_from_json(read_items(job), job["packed"])
    eval_pairs = [PairExample(**p) for p in job["eval_pairs"]]
    tokenizer = AutoTokenizer.from_pretrained(job["base_path"])
    pad = tokenizer.pad_token_id
    total = total_steps(config.train, len(items))
    eng = trainer.build_engine(job["base_path"], config.train, config.lora, total, load_reward_backbone)
    loss_of = reward_loss(config.loss)
    dev = trainer.device()

    def loss_fn(engine, batch):
        chosen, rejected = pair_rewards(engine.module, batch)
        losses = loss_of(RewardPair(chosen, rejected, batch["margin"]))
        return losses.sum(), {
            "accuracy": (chosen > rejected).float().sum(),
            "chosen_reward": chosen.detach().sum(),
            "rejected_reward": rejected.detach().sum(),
        }

    def score_eval() -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = [], []
        for i in range(0, len(eval_pairs), config.train.micro_train_batch_size):
            batch = {k: v.to(dev) for k, v in collate_pairs(eval_pairs[i : i + config.train.micro_train_batch_size], pad).items()}
            c, r = pair_rewards(eng.engine.module, batch)
            chosen.append(c.cpu())
            rejected.append(r.cpu())
        return torch.cat(chosen), torch.cat(rejected)

    def evaluate() -> dict[str, float]:
        c, r = score_eval()
        return {"accuracy": (c > r).float().mean().item(), "chosen_reward": c.mean().item(), "rejected_reward": r.mean().item()}

    def export(folder: Path) -> dict[str, float]:
        """The model as it is now, with its held-out reward statistics in its config (for normalize_reward)."""
        stats = {}
        if eval_pairs:
            eng.engine.eval()
            with torch.no_grad():
                c, r = score_eval()
            eng.engine.train()
            allr = torch.cat([c, r])
            stats = {"reward_mean": allr.mean().item(), "reward_std": allr.std().item(), "eval_accuracy": (c > r).float().mean().item()}
        model = eng.engine.module.get_base_model() if eng.is_peft else eng.engine.module
        model.config.update({k: v for k, v in stats.items() if k.startswith("reward_")})
        trainer.export_hf(eng, folder, tokenizer, rank)
        return stats

    history = trainer.fit(
        eng, items, lambda its: collate_pairs(its, pad), loss_fn, num_pairs, config.train, total,
        Path(job["run_dir"]), rank, world_size, evaluate=evaluate if eval_pairs else None, eval_steps=config.eval_steps,
        export=export,
    )
    stats = export(Path(job["export_dir"]))
    return {"final": history[-1] if history else {}, "steps": total, "reward_stats": stats}


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(STAGE, RewardModelConfig, run_reward_model, (Input("base", (POLICY,), field="base"),),
                 output=trained_output(REWARD, REWARD_ADAPTER), files=("data.paths", "eval_data.paths"),
                 metrics=lambda config: training_metrics(config, ("accuracy", "chosen_reward", "rejected_reward"),
                                                         # the held-out metrics, and the manifest's reward_stats
                                                         ("accuracy", "chosen_reward", "rejected_reward"),
                                                         ("reward_mean", "reward_std") if config.eval_data else ()))

if __name__ == "__main__":
    main()
