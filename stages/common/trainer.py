"""The training core shared by SFT, RM and DPO: DeepSpeed engine, step loop, resume, metrics, export.

Runs inside one rank (see ``launcher``). A stage supplies its items, a ``collate`` function, a
``loss_fn(module, batch) -> (loss_sum, metric_sums)`` and a per-item ``weight`` (SFT: loss tokens,
DPO/RM: 1). The loss of an optimizer step is ``sum of loss_sum over the global batch / sum of
weights``; each micro-batch's backward is scaled so that DeepSpeed's averaging over accumulation
steps and ranks yields exactly that gradient, whatever the split into micro-batches and ranks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints.state import commit_state, resumable_state, tag_of
from datasets_prep.packing import BatchSchedule
from stages.common.config import LoraConfig, SaveBestConfig, TrainConfig
from stages.common.progress import report_progress

STATE_DIR = "state"


_LISTENERS: list = []  # rank 0's bound rendezvous socket, kept open for the store's lifetime


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout):
    """The TCP store a group meets at: rank 0 serves it on ``host`` only (torch's own store binds every
    interface, so the socket is bound here and handed to ``TCPStore``), the other ranks connect to it. With a
    loopback ``host`` the collectives' own sockets stay on loopback too (``GLOO_SOCKET_IFNAME``/
    ``NCCL_SOCKET_IFNAME=lo`` unless set)."""
    import socket

    import torch.distributed as dist

    if host in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # alone, a rank needs no agreed port: the kernel's free one cannot have been taken since it was picked
    listener = socket.create_server((host, 0 if world_size == 1 else port), family=family, backlog=max(128, world_size))
    _LISTENERS.append(listener)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=listener.fileno())


def init_distributed() -> None:
    """Join the group described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (gloo on CPU, NCCL on GPU),
    meeting at :func:`rendezvous_store` (rank 0's store listens on MASTER_ADDR only)."""
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = timedelta(seconds=float(os.environ.get("RLHF_RENDEZVOUS_TIMEOUT_S", "600")))
        store = rendezvous_store(host, port, rank, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def deepspeed_config(train: TrainConfig) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": train.zero_stage}
    if train.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    return {
        "train_batch_size": train.train_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_train_batch_size,
        "gradient_accumulation_steps": train.accumulation_steps,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": train.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


@dataclass
class Engine:
    engine: Any  # deepspeed.DeepSpeedEngine
    ds_config: dict
    hf_ds_config: Any  # transformers' HfDeepSpeedConfig; must stay alive for ZeRO-3 from_pretrained
    is_peft: bool


def build_engine(model_path: str, train: TrainConfig, lora: LoraConfig, total_steps: int, model_loader: Callable) -> Engine:
    """Verify the checkpoint at ``model_path`` (every file against its manifest: the rank reads what the
    stage checked, not what may have changed since), load the model (ZeRO-3 partitioned at load when
    stage 3), add LoRA, wrap in DeepSpeed."""
    import deepspeed
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup
    from transformers.integrations import HfDeepSpeedConfig

    from checkpoints import verify

    ds_config = deepspeed_config(train)
    hf_ds = HfDeepSpeedConfig(ds_config) if train.zero_stage == 3 else None
    verify(model_path)
    torch.manual_seed(train.seed)
    model = model_loader(model_path)
    from stages.common.vision import freeze_vision_tower, is_vision, language_lora_targets

    vision = is_vision(model_path)
    if vision and train.freeze_vision_tower:
        freeze_vision_tower(model)
    if train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        if train.gradient_checkpointing:
            model.enable_input_require_grads()
        task = "SEQ_CLS" if getattr(model.config, "num_labels", 0) == 1 and hasattr(model, "score") else "CAUSAL_LM"
        model = get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=language_lora_targets(model, lora.target_modules) if vision else lora.target_modules,
                task_type=task,
            ),
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, betas=train.adam_betas, weight_decay=train.weight_decay)
    warmup = int(train.warmup_ratio * total_steps)
    if train.lr_scheduler == "cosine":

        def scheduler(opt):
            return get_cosine_with_min_lr_schedule_with_warmup(
                opt, num_warmup_steps=warmup, num_training_steps=total_steps, min_lr_rate=train.min_lr_ratio
            )
    else:

        def scheduler(opt):
            return get_constant_schedule_with_warmup(opt, num_warmup_steps=warmup)

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return Engine(engine, ds_config, hf_ds, lora.enabled)


def build_reference_engine(path: str, train: TrainConfig):
    """A frozen, optimizer-less DeepSpeed engine (ZeRO-3 partitioned when the policy is): DPO's and RL's
    reference model. Returns the engine and the ``HfDeepSpeedConfig`` to keep alive beside it."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    from stages.common.vision import model_class

    ds = {
        "train_micro_batch_size_per_gpu": train.micro_train_batch_size,
        "train_batch_size": train.train_batch_size,
        "zero_optimization": {"stage": 3 if train.zero_stage == 3 else 0, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": train.dtype == "bf16"},
    }
    keep = HfDeepSpeedConfig(ds) if train.zero_stage == 3 else None
    model = model_class(path).from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    return engine, keep


def kept_metric_lines(path: Path) -> list[str]:
    """The lines of a ``metrics.jsonl``; a torn last line (a kill mid-write) is dropped, a bad line
    elsewhere is an error naming the file and the line."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    out = []
    for i, ln in enumerate(lines):
        try:
            row = json.loads(ln)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as e:
            if i == len(lines) - 1:
                break  # torn by a kill mid-write: the step is redone after the resume
            raise ValueError(f"{path}: line {i + 1} is not a metrics record ({e}): {ln[:80]!r}") from e
        out.append(ln)
    return out


class MetricsWriter:
    """Rank 0 only: one JSON line per step, the same scalars to TensorBoard and, when the stage's config sets
    ``logging.wandb``, to Weights & Biases. ``config``: the stage's config as JSON (unset: the one in the
    stage's job, ``run_dir/job.json``, which the launcher writes for the stages whose ranks it starts)."""

    def __init__(self, run_dir: Path, start_step: int, enabled: bool, prefix: str = "train", config: dict | None = None):
        self.enabled, self.prefix, self.wandb = enabled, prefix, None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        from stages.common.identity import record_dir

        record = record_dir(run_dir)  # a rerun of a committed output writes beside its record (swapped at commit)
        record.mkdir(parents=True, exist_ok=True)
        self.path = record / "metrics.jsonl"
        if self.path.is_file():  # resuming: keep the steps that happened before the resume point
            kept = [ln for ln in kept_metric_lines(self.path) if json.loads(ln)["step"] <= start_step]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            tmp.replace(self.path)
        self.file = open(self.path, "a")
        self.tb = SummaryWriter(str(record / "tensorboard"), purge_step=start_step + 1)
        self.wandb = start_wandb(run_dir, config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(f"{self.prefix}/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({f"{self.prefix}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def start_wandb(run_dir: Path, config: dict | None = None):
    """The W&B run of this stage run (``None`` unless its config sets ``logging.wandb``): id = the run
    folder's name (a resumed run continues it), config = the stage's config (given, else the job's), files
    under ``run_dir/wandb``."""
    from stages.common.config import LoggingConfig

    if config is None:
        job = run_dir / "job.json"
        config = json.loads(job.read_text()).get("config", {}) if job.is_file() else {}
    wb = LoggingConfig.model_validate(config.get("logging") or {}).wandb
    if wb is None:
        return None
    import wandb

    return wandb.init(project=wb.project, entity=wb.entity, name=wb.name or run_dir.name, group=wb.group, tags=wb.tags or None,
                      mode=wb.mode, id=run_dir.name, resume="allow", dir=str(run_dir), config=config)


def maybe_inject_fault(step: int, rank: int, after: str | None = None) -> None:
    """Test hook: RLHF_FAULT_STEP=N makes rank RLHF_FAULT_RANK crash (exit), raise or hang after step N
    (``after``: what the message says the fault came after, e.g. ``RL step``; else the step and the rank)."""
    at = os.environ.get("RLHF_FAULT_STEP")
    if at is None or int(at) != step or int(os.environ.get("RLHF_FAULT_RANK", "0")) != rank:
        return
    mode = os.environ.get("RLHF_FAULT_MODE", "raise")
    if mode == "exit":
        os._exit(3)
    if mode == "hang":
        hang()
    raise RuntimeError(f"injected fault after {after} {step}" if after else f"injected fault at step {step} on rank {rank}")


def injected(hook: str) -> bool:
    """Test hook: whether the environment variable ``hook`` (e.g. RLHF_FAULT_SKIP_PUSH) is set to 1."""
    return os.environ.get(hook) == "1"


def injected_step(hook: str, who: int) -> int | None:
    """Test hook: ``hook=WHO:N`` (e.g. RLHF_FAULT_ENGINE_DIES=1:3) gives ``N`` to ``who`` (an actor's index), else None."""
    value = os.environ.get(hook, "")
    target, _, n = value.partition(":")
    return int(n) if value and int(target) == who else None


def hang() -> None:
    """Test hook: never return (a rank stuck in a collective or a dead filesystem, as the deadlines see it)."""
    while True:
        time.sleep(3600)


def maybe_hang(where: str, rank: int) -> None:
    """Test hook: RLHF_FAULT_HANG=WHERE:RANK makes that rank hang at ``where`` (e.g. ``learner.train:0``)."""
    if os.environ.get("RLHF_FAULT_HANG") == f"{where}:{rank}":
        hang()


def save_state(engine, state_dir: Path, step: int, client: dict, keep_last: int, rank: int) -> None:
    """DeepSpeed checkpoint of ``engine`` under ``state_dir/step<step>`` (collective), then rank 0 commits it
    (:func:`checkpoints.state.commit_state`: the manifest written last makes it the state to resume from)."""
    import torch.distributed as dist

    engine.save_checkpoint(str(state_dir), tag=tag_of(step), client_state={"step": step, **client}, save_latest=False)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        commit_state(state_dir, step, keep_last)


def fit(
    eng: Engine,
    items: Sequence[Any],
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    loss_fn: Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    weight: Callable[[Any], float],
    train: TrainConfig,
    total_steps: int,
    run_dir: Path,
    rank: int,
    world_size: int,
    evaluate: Callable[[], dict[str, float]] | None = None,
    eval_steps: int = 0,
    export: Callable[[Path], None] | None = None,
) -> list[dict[str, float]]:
    """The step loop. Returns the per-step metrics (on every rank).

    ``evaluate`` (called on every rank, in eval mode, every ``eval_steps`` and after the last step)
    returns held-out metrics, logged with an ``eval_`` prefix. ``export(folder)`` (every rank; rank 0 writes):
    with ``train.save_best``, each step whose metric improves is exported to ``run_dir/best`` (:class:`Best`).
    """
    from tqdm import tqdm

    engine = eng.engine
    schedule = BatchSchedule(len(items), train.train_batch_size, train.micro_train_batch_size, world_size, train.seed)
    start = _resume(engine, run_dir, train)
    best = Best(train.save_best, run_dir, rank, fresh=start == 0) if train.save_best is not None and export is not None else None
    writer = MetricsWriter(run_dir, start, enabled=rank == 0)
    history: list[dict[str, float]] = []
    bar = tqdm(total=total_steps, initial=start, disable=rank != 0 or not train.progress_bar, desc="train")
    engine.train()
    for step in range(start, total_steps):
        t0 = time.perf_counter()
        norm = float(sum(weight(items[i]) for i in schedule.global_batch(step)))
        if norm <= 0:
            raise ValueError(f"step {step + 1}: the global batch has no loss weight (no target tokens)")
        lr = engine.get_lr()[0]
        batches = ({k: v.to(device()) for k, v in collate([items[i] for i in micro]).items()} for micro in schedule.micro_batches(step, rank))
        metrics = _optimizer_step(engine, batches, loss_fn, train.accumulation_steps * world_size / norm, world_size, norm)
        _add_step_metrics(metrics, engine, lr, time.perf_counter() - t0)
        if evaluate is not None and ((eval_steps and (step + 1) % eval_steps == 0) or step + 1 == total_steps):
            metrics.update(_evaluated(engine, evaluate))
        if best is not None:
            best.offer(step + 1, metrics, export)
        history.append({"step": step + 1, **metrics})
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        _finish_step(engine, step + 1, total_steps, metrics, writer, train, run_dir, rank)
    bar.close()
    writer.close()
    return history


def _add_step_metrics(metrics: dict[str, float], engine, lr: float, elapsed: float) -> None:
    """What every step logs beside its loss function's metrics (``stages.common.stage_run.FIT_METRICS``)."""
    grad_norm = engine.get_global_grad_norm()
    metrics.update(
        lr=lr,
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        tokens_per_s=metrics.pop("tokens") / elapsed,  # positions processed, padding included
        step_time_s=elapsed,
    )


class Best:
    """``train.save_best``: the best step so far by one logged metric, its weights exported to ``run_dir/best`` (a
    better step replaces them; ``best.json``, written after the weights, says which step and value, and carries
    over a resume)."""

    FOLDER, RECORD = "best", "best.json"

    def __init__(self, cfg: SaveBestConfig, run_dir: Path, rank: int, fresh: bool):
        """``fresh``: the run starts at step 0, so a best of an earlier attempt is not this run's (dropped)."""
        self.metric, self.mode, self.run_dir, self.rank = cfg.metric, cfg.mode, run_dir, rank
        record = run_dir / self.RECORD
        if fresh and rank == 0:
            record.unlink(missing_ok=True)
        self.value = None if fresh or not record.is_file() or not (run_dir / self.FOLDER).is_dir() else json.loads(record.read_text())["value"]

    def better(self, value: float) -> bool:
        return self.value is None or (value < self.value if self.mode == "min" else value > self.value)

    def offer(self, step: int, metrics: dict[str, float], export: Callable[[Path], None]) -> None:
        import shutil

        value = metrics.get(self.metric)
        if value is None or value != value or not self.better(value):  # not logged at this step, or NaN
            return
        staged = self.run_dir / f".{self.FOLDER}.partial"
        if self.rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
        export(staged)  # collective under ZeRO-3: every rank gathers, rank 0 writes
        if self.rank == 0:
            (self.run_dir / self.RECORD).unlink(missing_ok=True)
            shutil.rmtree(self.run_dir / self.FOLDER, ignore_errors=True)
            os.replace(staged, self.run_dir / self.FOLDER)
            (self.run_dir / self.RECORD).write_text(json.dumps({"metric": self.metric, "mode": self.mode, "step": step,
                                                                "value": value}))
        self.value = value


def _finish_step(engine, done: int, total_steps: int, metrics: dict[str, float], writer: MetricsWriter, train: TrainConfig,
                 run_dir: Path, rank: int) -> None:
    """Log the step (every ``logging_steps`` and the last), report progress, save the state on its cadence (not
    after the last step), then the test hook."""
    if done % train.logging_steps == 0 or done == total_steps:
        writer.write(done, metrics)
    if rank == 0:
        report_progress(done, total_steps, metrics)
    if train.save_steps and done % train.save_steps == 0 and done < total_steps:
        save_state(engine, run_dir / STATE_DIR, done, {"torch_rng": torch.get_rng_state()}, train.keep_last, rank)
    maybe_inject_fault(done, rank)


def _resume(engine, run_dir: Path, train: TrainConfig) -> int:
    """With ``train.resume``: load the committed state (weights, optimizer, scheduler, RNG); the step it is at."""
    saved = resumable_state(run_dir / STATE_DIR) if train.resume else None
    if saved is None:
        return 0
    _, client = engine.load_checkpoint(str(run_dir / STATE_DIR), tag=saved.tag)
    torch.set_rng_state(client["torch_rng"])
    return int(client["step"])


def _optimizer_step(engine, batches, loss_fn, scale: float, world_size: int, norm: float) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches: each loss sum's backward scaled by ``scale`` (so that
    DeepSpeed's averaging gives the step's loss / ``norm``); the metric sums over every rank, divided by ``norm``,
    and the positions processed (``tokens``, padding included)."""
    import torch.distributed as dist

    sums: dict[str, torch.Tensor] = {}
    tokens = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        loss_sum, metric_sums = loss_fn(engine, batch)
        engine.backward(loss_sum * scale)
        engine.step()
        for k, v in {"loss": loss_sum, **metric_sums}.items():
            sums[k] = sums.get(k, torch.zeros((), dtype=torch.float64)) + v.detach().double().cpu()
        tokens += float(batch["input_ids"].numel())
    keys = sorted(sums)
    packed = torch.stack([sums[k] for k in keys] + [tokens])
    if world_size > 1:
        dist.all_reduce(packed)
    return {**{k: float(packed[i]) / norm for i, k in enumerate(keys)}, "tokens": float(packed[-1])}


def _evaluated(engine, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``evaluate()`` in eval mode without gradients, its metrics prefixed ``eval_``."""
    engine.eval()
    with torch.no_grad():
        out = {f"eval_{k}": v for k, v in evaluate().items()}
    engine.train()
    return out


def gathered(eng: Engine):
    """Full parameters on every rank inside the block (ZeRO-3 gathers them; other stages hold them whole)."""
    import deepspeed

    if eng.ds_config["zero_optimization"]["stage"] != 3:
        return nullcontext()
    return deepspeed.zero.GatheredParameters(list(eng.engine.module.parameters()), modifier_rank=None)


def export_hf(eng: Engine, out_dir: Path, tokenizer, rank: int) -> None:
    """Write the trained model (or the LoRA adapter) as an HF folder on rank 0, ZeRO-3 gathered."""

    module = eng.engine.module
    with gathered(eng):
        if rank == 0:
            module.save_pretrained(str(out_dir), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out_dir))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def forward_logits(eng: Engine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the engine's module on a batch (every rank must call it under ZeRO-3)."""
    eng.engine.eval()
    with torch.no_grad():
        out = eng.engine(**{k: v.to(device()) for k, v in batch.items() if k != "loss_mask"}, use_cache=False)
    return out.logits.float().cpu()
