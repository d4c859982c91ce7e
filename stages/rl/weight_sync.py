"""Weight sync: the learners' weights pushed to every rollout engine, then verified on a fixed probe.

Two transports (``sync.transport``):

- ``broadcast`` (default): learner rank 0 and every engine worker form one process group at startup
  (:meth:`WeightSync.connect`; gloo on CPU, NCCL on GPU); a push broadcasts the weights in buckets
  (``sync.bucket_mb``), ZeRO-3 gathered one module at a time on the learners, loaded by each worker as they
  arrive (``stages.rl.broadcast``).
  The learners and the engines are waited on together: an engine that dies mid-push fails the step at once,
  named (:func:`stages.common.cluster.ray_get_together`).
- ``object_store``: rank 0 gathers the state dict into safetensors bytes, puts them once in Ray's object store,
  and every engine loads them (for engines that can't join a group).

Both load with the worker's ``reload_weights``. Sleeping engines (``rollout.enable_sleep``) wake their weights'
memory before a push and their KV cache after it. Verification: every engine's log-probs of the probe (the first
samples of the run's first step) are compared with the learner's; a mean gap above ``sync_tolerance`` stops
the run (:class:`SyncError`): a stale or half-loaded engine shifts every token, rounding only a few.
"""

from __future__ import annotations

import torch

from stages.common.cluster import Deadlines
from stages.common.logprobs import logprob_difference
from stages.common.trainer import injected
from stages.rl.config import RLConfig
from stages.rl.experience import Samples
from stages.rl.rollout import EnginePool


class SyncError(RuntimeError):
    """vLLM's log-probs after a weight push do not match the learner's."""


class WeightSync:
    def __init__(self, cfg: RLConfig, learners: list, engines: EnginePool, deadlines: Deadlines, gpu: bool,
                 vision_path: str | None = None):
        """``vision_path``: a vision-language policy's folder (the processor that collapses the probe's image blocks
        for vLLM)."""
        self.cfg, self.learners, self.engines, self.deadlines = cfg, learners, engines, deadlines
        self.vision_path = vision_path
        self.backend = cfg.sync_backend(gpu)
        self.probe: dict[str, torch.Tensor] | None = None
        self.meta: list | None = None  # what a broadcast push sends: (name, shape, dtype) in order

    def call(self, refs, what: str):
        return self.deadlines.call(refs, what)

    def connect(self) -> None:
        """``broadcast``: learner rank 0 and every engine worker join the weight-sync group; the push's tensor list."""
        if self.cfg.sync.transport != "broadcast":
            return
        ro, timeout = self.cfg.rollout, self.cfg.ray.call_timeout_s
        master = self.deadlines.startup(self.learners[0].address.remote(), "learner.address")
        world = 1 + ro.num_engines * ro.tensor_parallel_size
        self.deadlines.together([
            ("learner.join_weight_group", [self.learners[0].join_weight_group.remote(master, world, self.backend, timeout)]),
            ("engine.join_weight_group", self.engines.join(master, ro.tensor_parallel_size, world, self.backend, timeout)),
        ], starting=True)
        self.meta = self.call([lr.weight_meta.remote(ro.dtype) for lr in self.learners], "learner.weight_meta")[0]

    def set_probe(self, samples: Samples) -> None:
        """A fixed probe, once: the first samples of the first step (two per learner rank), checked at once."""
        if self.probe is None:
            self.probe = {k: v[: len(self.learners) * 2] for k, v in samples.tensors().items()}
            if self.cfg.verify_sync:
                self.verify()

    def push(self) -> tuple[float, float]:
        """Push the learners' weights to every engine; the probe's mean and max |log-prob difference|."""
        import ray

        dtype = self.cfg.rollout.dtype
        self.engines.wake_up(["weights"])
        if self.cfg.sync.transport == "broadcast":
            if not injected("RLHF_FAULT_SKIP_PUSH"):  # test hook: a push that silently does nothing
                bucket = int(self.cfg.sync.bucket_mb * 2**20)
                self.deadlines.together([("learner.broadcast_weights", [lr.broadcast_weights.remote(bucket) for lr in self.learners]),
                                         ("engine.receive_weights", self.engines.receive(self.meta, bucket))])
        else:
            data = self.call([lr.weights_bytes.remote(dtype) for lr in self.learners], "learner.weights_bytes")[0]
            if not injected("RLHF_FAULT_SKIP_PUSH"):
                self.engines.push(ray.put(data))
        self.engines.wake_up(["kv_cache"])
        return self.verify() if self.cfg.verify_sync else (float("nan"), float("nan"))

    def verify(self) -> tuple[float, float]:
        """Mean and max |log-prob difference| between every engine and the learners on the probe.

        The check is on the mean over the probe's tokens: bf16 rounding moves single unlikely tokens by
        more than a real update does, while a stale or half-loaded engine shifts them all."""
        probe, cfg = self.probe, self.cfg
        learner = self.call([lr.probe_logprobs.remote(probe) for lr in self.learners], "learner.probe_logprobs")[0]
        seqs = [row[row_mask.bool()].tolist() for row, row_mask in zip(probe["input_ids"], probe["attention_mask"])]
        images = None
        if "images" in probe:  # a vision-language model's probe: vLLM takes one image token per image, and the images
            from stages.common.vision import collapse_images

            images = probe["images"]
            seqs = [collapse_images(s, refs, self.vision_path) for s, refs in zip(seqs, images, strict=True)]
        mean, worst = 0.0, 0.0
        for lps in self.engines.sequence_logprobs(seqs, images):
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
