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


def signal_metrics(exp: Experience, group_size: int, group_baseline: bool) -> dict[str, float]:
    """Whether the step can teach the policy anything: ``zero_std_share``, the share of prompt groups whose (shaped)
    rewards are all equal; ``zero_advantage_share``, the share of samples whose advantages are all 0; ``no_signal``
    1.0 when the rewards give no direction (a group-baseline estimator: every group's rewards equal; another:
    every reward of the step equal)."""
    rewards = exp.shaped.float()
    groups = rewards.view(-1, group_size)
    flat = (groups.max(-1).values - groups.min(-1).values).abs() <= 1e-8
    mask = exp.samples.response_mask.bool()
    zero_adv = ((exp.advantages.abs() <= 1e-8) | ~mask).all(-1)
    silent = bool(flat.all()) if group_baseline else float(rewards.max() - rewards.min()) <= 1e-8
    return {"zero_std_share": flat.float().mean().item(), "zero_advantage_share": zero_adv.float().mean().item(),
            "no_signal": float(silent)}


def no_signal_reason(exp: Experience, group_size: int) -> str:
    """Why a step had no learning signal, in words (for the warning and the stage's error): one reward value for
    the whole step, or equal rewards within each group (only a group-baseline estimator lacks signal then)."""
    rewards = exp.shaped.float()
    values = sorted({round(v, 6) for v in rewards.tolist()})
    if len(values) == 1:
        return f"every reward was {values[0]:g}"
    return (f"every group of {group_size} samples got equal rewards (values seen: "
            f"{', '.join(f'{v:g}' for v in values[:5])}{', ...' if len(values) > 5 else ''})")


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
