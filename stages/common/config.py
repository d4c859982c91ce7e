"""Config models shared by the training stages (fields typed with these, not base classes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainConfig(BaseModel):
    """DeepSpeed, batch, optimizer and schedule settings of a training stage."""

    model_config = ConfigDict(extra="forbid")

    world_size: int = 1  # ranks on this machine (CPU: gloo, GPU: NCCL, one GPU each)
    zero_stage: Literal[0, 1, 2, 3] = 2
    dtype: Literal["bf16", "fp32"] = "bf16"
    train_batch_size: int = 32  # global, across ranks and accumulation steps
    micro_train_batch_size: int = 8  # per rank per forward
    max_steps: int | None = None  # optimizer steps; None = num_epochs over the data
    num_epochs: int = 1
    lr: float = 1e-3
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = 0.05
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine floor as a fraction of lr
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = Field(1.0, gt=0)
    gradient_checkpointing: bool = False
    seed: int = 42
    save_steps: int = Field(0, ge=0)  # in-stage checkpoint every N steps; 0 = none
    resume: bool = False  # continue from the latest in-stage checkpoint of the same run
    keep_last: int = Field(1, ge=1)  # in-stage checkpoints kept (state/step<N>); older ones are removed once a newer one is committed
    logging_steps: int = Field(1, ge=1)
    # deadline of the stage's ranks as a whole (start to export); past it every rank is ended and the ranks
    # still running are named. RL: the driver's calls have their own deadline (ray.call_timeout_s)
    timeout_s: float = Field(24 * 3600.0, gt=0)
    progress_bar: bool = True

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

    rank: int = Field(0, ge=0)
    alpha: int = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class WandbConfig(BaseModel):
    """Weights & Biases logging beside metrics.jsonl and TensorBoard (OpenRLHF's ``--use_wandb``): the same
    scalars per step, the stage's config as the W&B run's config. The W&B run id is the stage's run folder
    name, so a resumed stage continues its W&B run. The API key comes from W&B's own ``WANDB_API_KEY`` /
    ``wandb login``; ``mode: offline`` writes under the run folder's ``wandb/`` for ``wandb sync`` later."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(min_length=1)
    entity: str | None = None
    name: str | None = None  # default: the run folder's name (<stage>-<run key>)
    group: str | None = None
    tags: list[str] = []
    mode: Literal["online", "offline", "disabled"] | None = None  # None: WANDB_MODE, else online


class LoggingConfig(BaseModel):
    """Where a training stage's metrics go besides ``metrics.jsonl`` and TensorBoard (not part of the run's identity)."""

    model_config = ConfigDict(extra="forbid")

    wandb: WandbConfig | None = None


class ClusterConfig(BaseModel):
    """Where a training stage's ranks run (not part of the run's identity: the same run on this machine or on a
    cluster gives the same result).

    ``address`` unset: this machine (SFT, RM, DPO: local rank processes; RL: its private loopback Ray cluster).
    Set (``auto``, ``host:port`` of the head's GCS, ``ray://host:port``): the stage joins that existing Ray cluster
    with the cluster's own authentication (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` in the environment), runs
    its ranks as Ray actors placed by one placement group, and leaves the cluster running. Every node must see the
    output root and the inputs at the same paths (a shared filesystem): checked before training."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None
    # how the ranks' bundles spread over nodes (Ray placement strategies): PACK fills a node first; SPREAD spreads
    # where it can; STRICT_SPREAD puts every bundle on its own node (one rank per node)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # None: GPU ranks when the cluster has GPUs (its resources decide, not the driver's machine)
    gpu: bool | None = None
    # ship the project's sources (stages, checkpoints, datasets_prep) with the job (Ray runtime_env py_modules);
    # false: every node runs the same image with the project installed
    ship_code: bool = True
    # joining the cluster and placing the ranks (the placement group becomes ready) must take at most this long
    connect_timeout_s: float = Field(60.0, gt=0)
