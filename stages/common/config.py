"""Config models shared by the training stages (fields typed with these, not base classes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_MISSING = object()


def given(data: Any, dotted: str) -> Any:
    """The value the raw config mapping ``data`` sets at ``dotted`` (``_MISSING`` when it sets none)."""
    *sections, leaf = dotted.split(".")
    for part in sections:
        data = data.get(part) if isinstance(data, Mapping) else None
    return data[leaf] if isinstance(data, Mapping) and leaf in data else _MISSING


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON sees them (a tuple default and the list a config file gives)."""
    return (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)


class StageConfig(BaseModel):
    """The base of a stage's config: a field it has from a shared section (``train``, ``data``) but does not read is
    listed in ``UNUSED`` (dotted path -> what to use instead) and refused by name when a recipe sets it, so no
    setting is accepted and ignored. ``--help`` leaves them out."""

    model_config = ConfigDict(extra="forbid")
    UNUSED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unused(cls, data: Any) -> Any:
        for dotted, instead in cls.UNUSED.items():
            from stages.common.cli import find_field

            value = given(data, dotted)
            # its default (inside the section's default instance: RL's train) passes (a whole config written out, e.g. to a rank's job file, carries every field)
            if value is not _MISSING and not _same(value, find_field(cls, dotted)[3]):
                raise ValueError(f"{dotted}: {value!r}: this stage does not read it; {instead}")
        return data

    @model_validator(mode="after")
    def _best_needs_its_metric(self) -> StageConfig:
        """``train.save_best`` on a held-out metric needs the held-out data that logs it."""
        best = getattr(getattr(self, "train", None), "save_best", None)
        if best is not None and best.metric.startswith("eval_") and getattr(self, "eval_data", False) is None:
            raise ValueError(f"train.save_best.metric: {best.metric!r} is a held-out metric and eval_data is not set (it "
                             "is what logs eval_* metrics)")
        return self


# what a stage that reads prompts (RL, eval) does not read of its data section
PROMPT_DATA_UNUSED = {
    "input_key": "prompts come from prompt_key", "output_key": "no responses are read (the policy generates them)",
    "chosen_key": "no preference pairs are read", "rejected_key": "no preference pairs are read",
    "margin_key": "no preference pairs are read", "score_keys": "no preference pairs are read",
    "prompt_marker": "prompts come from prompt_key", "max_len": "prompts are not truncated (rollout.max_model_len bounds RL)",
    "overflow": "prompts are not truncated", "packing": "prompts are not packed", "pretrain_mode": "prompts are not trained on",
}
# of an SFT data section
SFT_DATA_UNUSED = {
    "prompt_key": "SFT reads input_key (and output_key)", "chosen_key": "SFT reads no preference pairs",
    "rejected_key": "SFT reads no preference pairs", "margin_key": "SFT reads no preference pairs",
    "score_keys": "SFT reads no preference pairs", "prompt_marker": "SFT reads input_key (and output_key)",
    "label_key": "SFT trains on output_key",
}
# of a preference-pair data section (reward model, DPO)
PAIR_DATA_UNUSED = {
    "input_key": "pairs read prompt_key, chosen_key and rejected_key", "output_key": "pairs read chosen_key and rejected_key",
    "label_key": "pairs read chosen_key and rejected_key", "pretrain_mode": "pairs are not plain text",
    "image_key": "preference pairs with images are not supported yet (SFT, RL and eval take images)",
    "max_images_per_prompt": "preference pairs with images are not supported yet",
}


def section_unused(section: str, unused: Mapping[str, str]) -> dict[str, str]:
    return {f"{section}.{k}": v for k, v in unused.items()}


class SaveBestConfig(BaseModel):
    """Keep the step with the best value of a logged metric as the stage's output (the last step's beside it)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(min_length=1, description="a metric the stage logs, e.g. eval_loss (held-out metrics carry the eval_ prefix; they are logged every eval_steps and after the last step)")
    mode: Literal["min", "max"] = Field("min", description="min: the lowest value is best; max: the highest")


class TrainConfig(BaseModel):
    """DeepSpeed, batch, optimizer and schedule settings of a training stage."""

    model_config = ConfigDict(extra="forbid")

    world_size: int = Field(1, description="ranks on this machine (CPU: gloo, GPU: NCCL, one GPU each)")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage (0: plain data parallel, 3: parameters sharded too)")
    dtype: Literal["bf16", "fp32"] = Field("bf16", description="training precision (bf16 mixed precision or fp32)")
    freeze_vision_tower: bool = Field(False, description="a vision-language model: its vision tower and connector stay frozen (OpenRLHF's --actor.freeze_visual_encoder); LoRA adapts the language model only either way")
    train_batch_size: int = Field(32, description="global, across ranks and accumulation steps")
    micro_train_batch_size: int = Field(8, description="per rank per forward")
    max_steps: int | None = Field(None, description="optimizer steps; None = num_epochs over the data")
    num_epochs: int = Field(1, description="passes over the data when max_steps is None")
    lr: float = Field(1e-3, description="peak learning rate (AdamW)")
    lr_scheduler: Literal["cosine", "constant"] = Field("cosine", description="cosine decay to min_lr_ratio x lr after warmup, or constant after warmup")
    warmup_ratio: float = Field(0.05, description="share of the steps with a linear warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping by global norm")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory, more compute)")
    seed: int = Field(42, description="data order and initialisation")
    save_best: SaveBestConfig | None = Field(None, description="{metric: eval_loss, mode: min}: the stage's output is the step with the best value of that logged metric (its manifest says which step and value); the last step's weights are committed beside it as checkpoint-last. null: the last step")
    save_steps: int = Field(0, ge=0, description="in-stage checkpoint every N steps; 0 = none")
    resume: bool = Field(False, description="continue from the latest in-stage checkpoint of the same run")
    keep_last: int = Field(1, ge=1, description="in-stage checkpoints kept (state/step<N>); older ones are removed once a newer one is committed")
    logging_steps: int = Field(1, ge=1, description="metrics every N steps")
    timeout_s: float = Field(24 * 3600.0, gt=0, description="deadline of the stage's ranks as a whole (start to export); past it every rank is ended and the ranks still running are named. RL: the driver's calls have their own deadline (ray.call_timeout_s)")
    progress_bar: bool = Field(True, description="a tqdm bar on stderr")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        for name in ("world_size", "train_batch_size", "micro_train_batch_size", "num_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be at least 1")
        per_step = self.micro_train_batch_size * self.world_size
        if self.train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size: {self.train_batch_size} is not divisible by micro_train_batch_size "
                f"({self.micro_train_batch_size}) x world_size ({self.world_size}) = {per_step}"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps: {self.max_steps} must be at least 1")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio: {self.warmup_ratio} must be in [0, 1)")
        if self.lr <= 0:
            raise ValueError(f"lr: {self.lr} must be positive")
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas: {list(self.adam_betas)} must each be in [0, 1)")
        return self

    @property
    def accumulation_steps(self) -> int:
        return self.train_batch_size // (self.micro_train_batch_size * self.world_size)


class LoraConfig(BaseModel):
    """LoRA adapters (peft). rank 0 trains the full model."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(0, ge=0, description="LoRA rank (r); 0 trains the full model")
    alpha: int = Field(16, gt=0, description="LoRA alpha (the update is scaled by alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA path")
    target_modules: list[str] | Literal["all-linear"] = Field("all-linear", description="the module names to adapt, or all-linear")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class WandbConfig(BaseModel):
    """Weights & Biases logging beside metrics.jsonl and TensorBoard (OpenRLHF's ``--use_wandb``): the same
    scalars per step, the stage's config as the W&B run's config. The W&B run id is the stage's run folder
    name, so a resumed stage continues its W&B run. The API key comes from W&B's own ``WANDB_API_KEY`` /
    ``wandb login``; ``mode: offline`` writes under the run folder's ``wandb/`` for ``wandb sync`` later."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(min_length=1, description="the W&B project")
    entity: str | None = Field(None, description="the W&B team or user (default: the API key's)")
    name: str | None = Field(None, description="default: the run folder's name (<stage>-<run key>)")
    group: str | None = Field(None, description="a W&B group (e.g. one per pipeline run)")
    tags: list[str] = Field([], description="W&B tags")
    mode: Literal["online", "offline", "disabled"] | None = Field(None, description="None: WANDB_MODE, else online")


class LoggingConfig(BaseModel):
    """Where a training stage's metrics go besides ``metrics.jsonl`` and TensorBoard (not part of the run's identity)."""

    model_config = ConfigDict(extra="forbid")

    wandb: WandbConfig | None = Field(None, description="Weights & Biases logging; null: off")


class ClusterConfig(BaseModel):
    """Where a training stage's ranks run (not part of the run's identity: the same run on this machine or on a
    cluster gives the same result).

    ``address`` unset: this machine (SFT, RM, DPO: local rank processes; RL: its private loopback Ray cluster).
    Set (``auto``, ``host:port`` of the head's GCS, ``ray://host:port``): the stage joins that existing Ray cluster
    with the cluster's own authentication (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` in the environment), runs
    its ranks as Ray actors placed by one placement group, and leaves the cluster running. Every node must see the
    output root and the inputs at the same paths (a shared filesystem): checked before training."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="null: this machine; auto, host:port (the head's GCS) or ray://host:port: that existing Ray cluster")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description="how the ranks' bundles spread over nodes (Ray placement strategies): PACK fills a node first; SPREAD spreads where it can; STRICT_SPREAD puts every bundle on its own node (one rank per node)")
    gpu: bool | None = Field(None, description="None: GPU ranks when the cluster has GPUs (its resources decide, not the driver's machine)")
    ship_code: bool = Field(True, description="ship the project's sources (stages, checkpoints, datasets_prep) with the job (Ray runtime_env py_modules); false: every node runs the same image with the project installed")
    connect_timeout_s: float = Field(60.0, gt=0, description="joining the cluster and placing the ranks (the placement group becomes ready) must take at most this long")
