"""Weight sync: the learners' weights pushed to every rollout engine, then verified on a fixed probe.

Transport today: learner rank 0 gathers the ZeRO-3 partitions into safetensors bytes (LoRA: merged into the
base weights), puts them once in Ray's object store, and every engine loads them with its worker's
``reload_weights`` (``stages.rl.rollout``). Verification: every engine's log-probs of the probe (the first
samples of the run's first step) are compared with the learner's; a mean gap above ``sync_tolerance`` stops
the run (:class:`SyncError`): a stale or half-loaded engine shifts every token, rounding only a few.
"""

from __future__ import annotations

import torch

from stages.common.logprobs import logprob_difference
from stages.common.trainer import injected
from stages.rl.config import RLConfig
from stages.rl.experience import Samples
from stages.rl.rollout import EnginePool


class SyncError(RuntimeError):
    """vLLM's log-probs after a weight push do not match the learner's."""


class WeightSync:
    def __init__(self, cfg: RLConfig, learners: list, engines: EnginePool, call):
        self.cfg, self.learners, self.engines, self.call = cfg, learners, engines, call  # call: Deadlines.call
        self.probe: dict[str, torch.Tensor] | None = None

    def set_probe(self, samples: Samples) -> None:
        """A fixed probe, once: the first samples of the first step (two per learner rank), checked at once."""
        if self.probe is None:
            self.probe = {k: v[: len(self.learners) * 2] for k, v in samples.tensors().items()}
            if self.cfg.verify_sync:
                self.verify()

    def push(self) -> tuple[float, float]:
        """Push the learners' weights to every engine; the probe's mean and max |log-prob difference|."""
        import ray

        data = self.call([lr.weights_bytes.remote(self.cfg.rollout.dtype) for lr in self.learners], "learner.weights_bytes")[0]
        if not injected("RLHF_FAULT_SKIP_PUSH"):  # test hook: a push that silently does nothing
            self.engines.push(ray.put(data))
        return self.verify() if self.cfg.verify_sync else (float("nan"), float("nan"))

    def verify(self) -> tuple[float, float]:
        """Mean and max |log-prob difference| between every engine and the learners on the probe.

        The check is on the mean over the probe's tokens: bf16 rounding moves single unlikely tokens by
        more than a real update does, while a stale or half-loaded engine shifts them all."""
        probe, cfg = self.probe, self.cfg
        learner = self.call([lr.probe_logprobs.remote(probe) for lr in self.learners], "learner.probe_logprobs")[0]
        seqs = [row[row_mask.bool()].tolist() for row, row_mask in zip(probe["input_ids"], probe["attention_mask"])]
        mean, worst = 0.0, 0.0
        for lps in self.engines.sequence_logprobs(seqs):
            ours = torch.cat([learner[i, 1 : len(lp) + 1] for i, lp in enumerate(lps)])
            m, w, counted = logprob_difference(torch.cat([torch.tensor(lp) for lp in lps]), ours, cfg.sync_min_prob)
            if not counted:
                raise SyncError(f"weight sync check: no probe token has probability >= sync_min_prob={cfg.sync_min_prob} "
                                "under the learner; lower sync_min_prob")
            mean, worst = max(mean, m), max(worst, w)
        if mean > cfg.sync_tolerance:
            raise SyncError(
                f"weight sync check failed: vLLM engine log-probs differ from the learner's by {mean:.4g} on average "
                f"(max {worst:.4g}) on the probe's tokens of probability >= {cfg.sync_min_prob} (tolerance "
                f"sync_tolerance={cfg.sync_tolerance}); the engine is not running the trained weights"
            )
        return mean, worst
