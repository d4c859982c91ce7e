"""One learner rank of the RL stage (a Ray actor): the policy's DeepSpeed engine and the reference.

All ranks form one torch.distributed group (gloo on CPU, NCCL on GPU); rank 0 hands out the address.
Under ZeRO-3 every forward is collective, so the driver always calls every rank with equal-sized
shards. The frozen reference model lives in the same process (an optimizer-less DeepSpeed engine,
partitioned like the policy), which is OpenRLHF's ``colocate_actor_ref``. The critic's ranks
(``stages.rl.critic``) are a group of their own, built on :class:`Rank` too.

What a rank trains on is a typed :class:`~stages.rl.experience.TrainBatch`; what the step needs is the
run's :class:`~stages.rl.experience.StepPlan`, decided once from the config.
"""

from __future__ import annotations

import os

import torch

from stages.common.cluster import GroupRank
from stages.common.logprobs import token_logps
from stages.rl.algorithms import (
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ISInput,
    PolicyLossInput,
    policy_objective,
)
from stages.rl.config import RLConfig
from stages.rl.experience import StepPlan, TrainBatch, used_width


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


class Rank(GroupRank):
    """What every DeepSpeed rank of the RL stage does alike: join its group, save and load its state."""

    def _join(self, config: dict, master: tuple[str, int]) -> None:
        from stages.common import trainer

        self.group_env(master)
        self.cfg = RLConfig.model_validate(config)
        self.plan = StepPlan.of(self.cfg)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        trainer.init_distributed()

    def save_state(self, path: str, step: int, tag: str) -> bool:
        """DeepSpeed checkpoint of this group's engine (weights, optimizer, scheduler) in ``path/tag``; collective."""
        self.eng.engine.save_checkpoint(path, tag=tag, client_state={"step": step}, save_latest=False)
        return True

    def load_state(self, path: str, tag: str) -> int:
        _, client = self.eng.engine.load_checkpoint(path, tag=tag)
        return int(client["step"])

    def _passes(self, updates: list[TrainBatch], micro_loss, prefix: str = "") -> dict[str, float]:
        """One pass over this rank's shares of the step's optimizer steps, micro-batch by micro-batch:
        ``micro_loss(part) -> (loss, {metric: sum})``; returns the metric sums, the mean grad norm and the lr."""
        from stages.common.trainer import device

        engine = self.eng.engine
        # DeepSpeed divides every micro-batch's loss by its configured accumulation steps and averages the
        # ranks' gradients; the losses here are already shares of the optimizer step's loss
        scale = self.cfg.train.accumulation_steps * self.world_size
        sums: dict[str, float] = {}
        grad_norms = []
        for update in updates:
            for i, (a, b) in enumerate(update.micro):
                # the micro-batch count may differ from the configured accumulation steps (token budgets)
                engine.set_gradient_accumulation_boundary(i == len(update.micro) - 1)
                loss, metrics = micro_loss(update.rows(a, b).trimmed().to(device()))
                engine.backward(loss * scale)
                engine.step()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
            gn = engine.get_global_grad_norm()
            grad_norms.append(float(gn) if gn is not None else float("nan"))
        sums[f"{prefix}grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        sums[f"{prefix}lr"] = engine.get_lr()[0]
        return sums


class Learner(Rank):
    policy_path: str | None = None
    banned: torch.Tensor | None = None  # a vision-language model's image tokens

    def setup(self, config: dict, policy_path: str, total_updates: int, master: tuple[str, int]) -> bool:
        from stages.common import trainer
        from stages.common.vision import is_vision, load_policy, vision_token_ids

        self._join(config, master)
        self.eng = trainer.build_engine(policy_path, self.cfg.train, self.cfg.lora, total_updates, load_policy)
        self.policy_path, self.banned = policy_path, None
        if is_vision(policy_path):  # what the engines never sample, out of the learners' distribution too
            from transformers import AutoTokenizer

            self.banned = torch.tensor(vision_token_ids(AutoTokenizer.from_pretrained(policy_path)), dtype=torch.long)
        self.ref = None
        if self.plan.ref_logp:
            self.ref, self._ref_keep = trainer.build_reference_engine(policy_path, self.cfg.train)
        return True

    def pixels(self, images: list[list[str]] | None) -> dict:
        """The pixel tensors of a batch's rows (a vision-language model's: each row's image references), on the device."""
        if images is None:
            return {}
        from stages.common.trainer import device
        from stages.common.vision import pixel_inputs

        return {k: v.to(device()) for k, v in pixel_inputs(self.policy_path, images).items()}

    def _forward_logps(self, module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       response_mask: torch.Tensor | None = None, with_entropy: bool = False, temperature: float | None = None,
                       pixels: dict | None = None):
        """Token log-probs (and the entropy of the distribution each was drawn from) of the policy sampled
        from: logits divided by the rollout temperature (``temperature=1.0``: the raw model, as vLLM's prompt
        log-probs on the probe). [b, T] each, entry t about token t. With ``response_mask``, the logits are
        computed only from the position before the batch's first response token on (``logits_to_keep``):
        entries before it are 0."""
        from torch.nn.functional import pad

        from stages.common.trainer import device

        ids = input_ids.to(device())
        start = 0
        if response_mask is not None and bool(response_mask.any()):
            start = max(0, int(response_mask.to(torch.long).argmax(-1)[response_mask.any(-1)].min()) - 1)
        out = module(input_ids=ids, attention_mask=attention_mask.to(device()), use_cache=False,
                     logits_to_keep=ids.shape[1] - start, **(pixels or {}))
        t = self.cfg.rollout.temperature if temperature is None else temperature
        logits = out.logits if t == 1.0 else out.logits / t  # positions start .. T-1
        if self.banned is not None and temperature is None:  # the sampling distribution: image tokens banned (as
            # vLLM's allowed_token_ids; finite, so masked-out positions stay 0 in sums); the probe's are raw
            logits = logits.index_fill(-1, self.banned.to(logits.device), -1e9)
        logp = pad(token_logps(logits, ids[:, start:]), (start, 0))
        if not with_entropy:
            return logp
        # entry t: the entropy of the distribution token t was drawn from (the logits at t - 1)
        if self.cfg.algo.entropy_coef:  # in the loss: with its gradient
            return logp, pad(_entropy(logits[:, :-1]), (start + 1, 0))
        with torch.no_grad():  # logged only
            return logp, pad(_entropy(logits[:, :-1].detach()), (start + 1, 0))

    def logprobs(self, batch: dict[str, torch.Tensor], policy: bool = True, reference: bool = True,
                 temperature: float | None = None) -> dict[str, torch.Tensor]:
        """Policy and/or reference log-probs of this rank's shard, micro-batch by micro-batch (at the rollout
        temperature unless one is given), each micro-batch without its padding columns."""
        from torch.nn.functional import pad

        micro = self.cfg.train.micro_train_batch_size
        width = batch["input_ids"].shape[1]
        out: dict[str, list[torch.Tensor]] = {"logp": [], "ref_logp": []}
        self.eng.engine.eval()
        with torch.no_grad():
            for i in range(0, batch["input_ids"].shape[0], micro):
                attn = batch["attention_mask"][i : i + micro]
                w = used_width(attn)
                ids, attn = batch["input_ids"][i : i + micro, :w], attn[:, :w]
                resp = batch["response_mask"][i : i + micro, :w] if "response_mask" in batch else None
                pixels = self.pixels(batch["images"][i : i + micro] if "images" in batch else None)
                for key, module, wanted in (("logp", self.eng.engine, policy), ("ref_logp", self.ref, reference)):
                    if wanted and module is not None:
                        lp = self._forward_logps(module, ids, attn, resp, temperature=temperature, pixels=pixels).float().cpu()
                        out[key].append(pad(lp, (0, width - w)))
        self.eng.engine.train()
        return {k: torch.cat(v) for k, v in out.items() if v}

    def train(self, updates: list[TrainBatch], kl_coef: float) -> dict[str, float]:
        """One pass over this rank's shares of the step's optimizer steps."""
        from stages.common.trainer import maybe_hang

        maybe_hang("learner.train", self.rank)
        return self._passes(updates, lambda part: self.micro_loss(self.eng.engine, part, kl_coef))

    def micro_loss(self, module, part: TrainBatch, kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
        """A micro-batch's share of the policy's loss for the optimizer step, and its metric sums."""
        algo, plan = self.cfg.algo, self.plan
        mask = part.response_mask.float()
        keep = mask.bool()
        logp, entropy = self._forward_logps(module, part.input_ids, part.attention_mask, part.response_mask, with_entropy=True,
                                            pixels=self.pixels(part.images))
        # on-policy (one update per rollout): the behaviour policy is the current one
        old_logp = part.old_logp if plan.old_logp else logp.detach()
        loss_fn, corrected = POLICY_LOSSES[algo.policy_loss], algo.is_correction is not None
        inp = PolicyLossInput(logp, loss_fn.behaviour(old_logp, part.rollout_logp, corrected), part.advantages, mask,
                              algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip)
        per_token, clipped = loss_fn(inp)
        extra = {}
        if loss_fn.weighted(corrected):
            per_token = per_token * IS_CORRECTIONS[algo.is_correction](ISInput(old_logp, part.rollout_logp, mask, *algo.is_threshold))
        if corrected:  # OpenRLHF's vllm_kl: how far the engine's sampling distribution is from the learners'
            extra["vllm_kl"] = float(torch.where(keep, part.rollout_logp - old_logp.detach(), 0.0).sum())
        kl = torch.where(keep, KL_ESTIMATORS[algo.kl_estimator](logp, part.ref_logp), 0.0) if plan.ref_logp else torch.zeros_like(logp)
        loss = policy_objective(per_token, mask, algo.loss_agg, part.normaliser, kl=kl if plan.kl_loss else None,
                                kl_coef=kl_coef, entropy=entropy, entropy_coef=algo.entropy_coef)
        return loss, {"policy_loss": float(torch.where(keep, per_token.detach(), 0.0).sum()),
                      "clip_ratio": float(clipped.float().sum()),
                      "entropy": float(torch.where(keep, entropy.detach(), 0.0).sum()),
                      "kl": float(kl.detach().sum()), "tokens": float(mask.sum()), **extra}

    def _named_weights(self):
        """The policy's weights as the engines load them, one module at a time (``stages.rl.broadcast``)."""
        from stages.rl.broadcast import named_weights

        return named_weights(self.eng.engine.module, self.eng.is_peft, self.cfg.train.zero_stage == 3)

    def weights_bytes(self, dtype: str) -> bytes | None:
        """``sync.transport: object_store``: the full policy state dict as safetensors bytes on rank 0 (every rank
        must call: ZeRO-3 gathers). With LoRA, the merged weights under the base model's names: what vLLM loads."""
        from safetensors.torch import save

        from stages.rl.broadcast import DTYPES

        target = DTYPES[dtype]
        state = {name: t.detach().to(target).cpu().contiguous().clone() for name, t in self._named_weights()}
        return save(state) if self.rank == 0 else None

    def join_weight_group(self, master: tuple[str, int], world_size: int, backend: str, timeout_s: float) -> bool:
        """Rank 0 joins the weight-sync group as its rank 0 (serving its store at ``master``); the others are not in it."""
        from stages.rl.broadcast import open_group

        if self.rank == 0:
            self.weight_group, self.weight_backend = open_group(*master, 0, world_size, backend, timeout_s), backend
        return True

    def weight_meta(self, dtype: str) -> list | None:
        """What a broadcast push sends, on rank 0 (every rank must call)."""
        self.meta = [(name, list(t.shape), dtype) for name, t in self._named_weights()]
        return self.meta if self.rank == 0 else None

    def broadcast_weights(self, bucket_bytes: int) -> int | None:
        """``sync.transport: broadcast``: rank 0 broadcasts the weights bucket by bucket as they are gathered (every
        rank must call); the number of broadcasts."""
        from stages.rl.broadcast import send, sync_device

        if self.rank != 0:
            for _ in self._named_weights():
                pass
            return None
        return send(self.weight_group, self._named_weights(), self.meta, sync_device(self.weight_backend), bucket_bytes)

    def offload_states(self) -> bool:
        """``train.enable_sleep``: the engine's parameters and optimizer states to host memory (DeepSpeed ZeRO-3's
        ``offload_states``) while the engines generate."""
        self.eng.engine.offload_states()
        return True

    def reload_states(self) -> bool:
        self.eng.engine.reload_states()
        return True

    def probe_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The raw model's log-probs (temperature 1, as vLLM's prompt log-probs) on the sync probe."""
        whole = {k: batch[k] for k in ("input_ids", "attention_mask", "images") if k in batch}  # every position, prompt included
        out = self.logprobs(whole, reference=False, temperature=1.0)["logp"]
        return out if self.rank == 0 else None

    def export(self, out_dir: str, tokenizer_path: str) -> bool:
        from pathlib import Path

        from stages.common import trainer
        from stages.common.vision import tokenizer_or_processor

        trainer.export_hf(self.eng, Path(out_dir), tokenizer_or_processor(tokenizer_path), self.rank)
        return True
