"""A step's metrics, from what the step produced (pure), and the timer of its phases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from stages.rl.experience import Experience
from stages.rl.sampler import Rollout


class PhaseTimer:
    """Seconds per phase of a step (``<phase>_s``), and the step's total since the timer began."""

    def __init__(self):
        self.start, self.times = time.perf_counter(), {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Count ``seconds`` measured inside phase ``src`` as phase ``dst`` instead."""
        self.times[src] -= seconds
        self.times[dst] = self.times.get(dst, 0.0) + seconds

    def total(self) -> dict[str, float]:
        return {**self.times, "total_s": time.perf_counter() - self.start}


def mean_kl(exp: Experience, kl_sum: float) -> float:
    """The step's mean per-token KL to the reference: measured on the samples (KL in the reward, or old log-probs
    at hand), else the learners' sum over their updates (``kl_sum``) per response token."""
    mask = exp.samples.response_mask.float()
    if exp.kl is not None:
        return float(exp.kl.sum() / mask.sum())
    return kl_sum / max(float(mask.sum()), 1.0)


def rollout_logprob_diff(exp: Experience) -> float | None:
    """Mean |vLLM's sampling log-prob - the learners' old log-prob| over every response token of the step: the
    engines and the learners hold the same weights, so this stays at rounding level unless a sync went wrong (a
    whole-batch check beside the probe's). None when either side is not at hand."""
    s, old = exp.samples, exp.forward.old_logp
    if s.rollout_logp is None or old is None:
        return None
    keep = s.response_mask.bool()
    return (s.rollout_logp[keep] - old[keep]).abs().mean().item() if keep.any() else 0.0


def step_metrics(rollout: Rollout, exp: Experience, updates: dict[str, float], kl: float, kl_coef: float,
                 sync: tuple[float, float], times: dict[str, float]) -> dict[str, float]:
    """Every scalar a step logs: rewards and scores, shaping, KL, lengths, the sampler's, the sync check's, the
    updates', the reward source's extra logs, the phase timings and the generation throughput."""
    samples, scores = rollout.samples, rollout.scores
    lengths = samples.response_mask.float().sum(-1)
    diff = rollout_logprob_diff(exp)
    return {
        "reward_mean": scores.rewards.mean().item(),
        "reward_std": scores.rewards.std().item(),
        "shaped_reward_mean": exp.shaped.mean().item(),  # after the length penalties
        "accuracy": scores.scores.mean().item(),
        "kl": kl,
        "kl_coef": kl_coef,
        "response_length": lengths.mean().item(),
        "truncated_share": samples.truncated.float().mean().item(),
        **rollout.metrics,
        "sync_logprob_diff": sync[0],
        "sync_max_logprob_diff": sync[1],
        **updates,
        **({"rollout_logprob_diff": diff} if diff is not None else {}),
        # NaN: not counted (e.g. an agent's second-attempt success on episodes solved at the first)
        **{k: v.float().nanmean().item() for k, v in scores.extra_logs.items() if not v.float().isnan().all()},
        **times,
        "generated_tokens_per_s": float(lengths.sum().item()) / max(times["generate_s"], 1e-9),
    }
