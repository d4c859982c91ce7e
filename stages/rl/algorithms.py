"""RL math: advantage estimators, KL estimators and policy losses, as pure functions in registries.

One signature per family, and each registry entry carries the traits the rest of the stage reads, so no
estimator or loss is named outside this module (and the tests):

- advantage estimators (:class:`Estimator`: ``needs_critic``, ``min_group``):
  ``(AdvantageInput) -> (advantages [B, T], returns [B, T])``
- KL estimators: ``(logp [B, T], ref_logp [B, T]) -> kl [B, T]``, every value clamped to [-10, 10]
- policy losses (:class:`PolicyLoss`: what the ratio is taken against, whether IS weights apply):
  ``(PolicyLossInput) -> (per-token loss [B, T], clipped [B, T] bool)``
- IS corrections of the engine/learner gap: ``(ISInput) -> weights [B, T]``
- the critic's loss: :func:`value_loss` (clipped, per token)

Numerical guards, as OpenRLHF's: KL values clamped to [-10, 10], the PPO log-ratio to [-20, 20] before
``exp``; and, beyond OpenRLHF, nothing at a masked position (padding, prompt) reaches a loss or a
gradient: inputs are zeroed there with ``torch.where`` before any arithmetic, so even an inf or NaN
log-prob at a masked position leaves the loss and every gradient finite.

Shapes: B sequences (prompts x ``n_samples_per_prompt``, grouped consecutively), T response tokens,
``mask`` [B, T] is 1 on response tokens. Follows OpenRLHF's definitions (``experience_maker.py``,
``ppo_utils``); deviations are stated where they occur.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------
# shaping helpers


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (global whitening, as OpenRLHF for REINFORCE++)."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def token_rewards(scores: torch.Tensor, kl: torch.Tensor | None, kl_coef: float, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every response token, the sequence score added on the
    last response token. scores [B] -> [B, T]."""
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    last = mask.shape[1] - 1 - mask.flip(-1).to(torch.long).argmax(-1)
    return rewards.scatter_add(1, last.unsqueeze(1), scores.unsqueeze(1))


def cumulative_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, over response tokens only. [B, T] -> [B, T]."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return returns * mask


# ---------------------------------------------------------------------------------------------
# advantage estimators


@dataclass
class AdvantageInput:
    scores: torch.Tensor  # [B] sequence rewards, groups of n consecutive samples per prompt
    mask: torch.Tensor  # [B, T]
    group_size: int
    kl: torch.Tensor | None = None  # [B, T] per-token KL to the reference, when KL is in the reward
    kl_coef: float = 0.0
    gamma: float = 1.0
    # clip the (baselined) sequence reward to [-c, c]. OpenRLHF clips the raw reward before its baseline;
    # here the clip applies to what the estimator hands on (for gae and reinforce: the raw reward too)
    reward_clip: float | None = None
    values: torch.Tensor | None = None  # [B, T] the critic's values at rollout time (estimators whose entry needs_critic)
    lambd: float = 1.0  # GAE's lambda


def _grouped(scores: torch.Tensor, n: int) -> torch.Tensor:
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} samples do not split into groups of n_samples_per_prompt={n}")
    return scores.view(-1, n)


def _finish(inp: AdvantageInput, scores: torch.Tensor, whiten_adv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if inp.reward_clip is not None:
        scores = scores.clamp(-inp.reward_clip, inp.reward_clip)
    returns = cumulative_returns(token_rewards(scores, inp.kl, inp.kl_coef, inp.mask), inp.mask, inp.gamma)
    adv = whiten(returns, inp.mask) if whiten_adv else returns
    return adv, returns


def reinforce(inp: AdvantageInput):
    """REINFORCE++ (Hu 2025): no baseline; per-token returns of reward - KL; global whitening."""
    return _finish(inp, inp.scores, whiten_adv=True)


def reinforce_baseline(inp: AdvantageInput):
    """REINFORCE++-baseline: subtract the group mean reward, then as REINFORCE++ (global whitening)."""
    g = _grouped(inp.scores, inp.group_size)
    return _finish(inp, (g - g.mean(-1, keepdim=True)).flatten(), whiten_adv=True)


def rloo(inp: AdvantageInput):
    """RLOO (Ahmadian et al. 2024): baseline = mean reward of the other n-1 samples of the prompt."""
    n = inp.group_size
    if n < 2:
        raise ValueError("rloo needs n_samples_per_prompt >= 2")
    g = _grouped(inp.scores, n)
    return _finish(inp, (g - (g.sum(-1, keepdim=True) - g) / (n - 1)).flatten(), whiten_adv=False)


def group_norm(inp: AdvantageInput):
    """GRPO (Shao et al. 2024): (r - group mean) / (group std + 1e-9). Std is the unbiased (n-1) one,
    as torch.std and OpenRLHF; groups whose samples all score the same get advantage 0."""
    g = _grouped(inp.scores, inp.group_size)
    return _finish(inp, ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-9)).flatten(), whiten_adv=False)


def dr_grpo(inp: AdvantageInput):
    """Dr. GRPO (Liu et al. 2025): r - group mean, no std division (paired with the
    ``seq_mean_token_sum_norm`` loss aggregation to remove the length bias too)."""
    g = _grouped(inp.scores, inp.group_size)
    return _finish(inp, (g - g.mean(-1, keepdim=True)).flatten(), whiten_adv=False)


def gae_advantages(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), as OpenRLHF's
    ``get_advantages_and_returns`` (the core of the ``gae`` estimator): delta_t = r_t + gamma V_{t+1} - V_t (V = 0 past a response's end),
    A_t = delta_t + gamma lambda A_{t+1}; returns = A + V (before any whitening). [B, T] each."""
    m = mask.to(values.dtype)
    values, rewards = values * m, rewards * m
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lambd * last
        adv[:, t] = last
    return adv * m, (adv + values) * m


def gae(inp: AdvantageInput):
    """PPO's estimator (OpenRLHF's default): GAE over the per-token rewards (the score on the last token,
    -kl_coef * KL on every token when KL is in the reward) with the critic's values; returns = A + V before
    whitening, then the advantages are whitened over the batch (as OpenRLHF)."""
    if inp.values is None:
        raise ValueError("gae needs the critic's values (AdvantageInput.values)")
    scores = inp.scores if inp.reward_clip is None else inp.scores.clamp(-inp.reward_clip, inp.reward_clip)
    adv, returns = gae_advantages(inp.values, token_rewards(scores, inp.kl, inp.kl_coef, inp.mask), inp.mask, inp.gamma, inp.lambd)
    return whiten(adv, inp.mask), returns


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what a run using it needs."""

    fn: Callable[[AdvantageInput], tuple[torch.Tensor, torch.Tensor]]
    needs_critic: bool = False  # reads AdvantageInput.values: the run trains a critic
    min_group: int = 1  # the fewest samples per prompt it can baseline a group with

    def __call__(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(inp)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(gae, needs_critic=True),
    "reinforce": Estimator(reinforce),
    "reinforce_baseline": Estimator(reinforce_baseline, min_group=2),
    "rloo": Estimator(rloo, min_group=2),
    "group_norm": Estimator(group_norm, min_group=2),
    "dr_grpo": Estimator(dr_grpo, min_group=2),
}

# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence", 2020), for KL(pi || ref) on pi's samples


KL_CLAMP = 10.0  # every estimator's value lies in [-10, 10], as OpenRLHF's compute_approx_kl


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref (unbiased, high variance, can be negative)."""
    return (logp - ref_logp).clamp(-KL_CLAMP, KL_CLAMP)


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log ref)^2 / 2 (biased, low variance, >= 0)."""
    return (0.5 * (logp - ref_logp) ** 2).clamp(-KL_CLAMP, KL_CLAMP)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log ref - log pi) - 1 - (log ref - log pi) (unbiased, >= 0). The log-ratio is clamped
    to [-20, 20] before exp so it cannot overflow, then the value to [-10, 10] (OpenRLHF clamps the value)."""
    r = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(r) - 1 - r).clamp(-KL_CLAMP, KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

# ---------------------------------------------------------------------------------------------
# policy losses


@dataclass
class PolicyLossInput:
    logp: torch.Tensor  # [B, T] current policy
    old_logp: torch.Tensor  # [B, T] behaviour policy (at rollout time)
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None  # c > 1: bound the loss of negative-advantage tokens at c * |A|


LOG_RATIO_CLAMP = 20.0  # the PPO log-ratio before exp, as OpenRLHF's PolicyLoss


def masked_inputs(inp: PolicyLossInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi - log pi_old, advantages, mask as bool) with zeros at masked positions, selected with
    ``torch.where`` so that whatever sits there (inf, NaN) reaches neither the loss nor the gradient."""
    keep = inp.mask.bool()
    zero = torch.zeros((), dtype=inp.logp.dtype, device=inp.logp.device)
    log_ratio = torch.where(keep, inp.logp - torch.where(keep, inp.old_logp, zero), zero)
    return log_ratio, torch.where(keep, inp.advantages, zero), keep


def ppo_clip(inp: PolicyLossInput) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip (Schulman et al. 2017) with separate low/high epsilon (DAPO's clip-higher) and
    optional dual-clip (Ye et al. 2020). Per-token loss [B, T] and where clipping was active."""
    log_ratio, adv, keep = masked_inputs(inp)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - inp.clip_eps_low, 1 + inp.clip_eps_high) * adv
    loss = -torch.min(surr1, surr2)
    clipped = surr2 < surr1
    if inp.dual_clip is not None:
        if inp.dual_clip <= 1:
            raise ValueError(f"dual_clip: {inp.dual_clip} must be > 1")
        bound = -inp.dual_clip * adv  # for A < 0: loss <= c * |A|
        neg = adv < 0
        clipped = clipped | (neg & (loss > bound))
        loss = torch.where(neg, torch.min(loss, bound), loss)
    return torch.where(keep, loss, 0.0), clipped & keep


def gspo(inp: PolicyLossInput) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of the token
    ratios, exp(mean_t(log pi - log pi_old)), clipped; the advantage is the sequence's (its mean
    over tokens). Returned per token (the sequence loss on each of its tokens) so the same
    aggregations apply; with ``seq_mean_token_mean`` it is exactly the paper's objective."""
    token_log_ratio, token_adv, keep = masked_inputs(inp)
    m = keep.to(inp.logp.dtype)
    lengths = m.sum(-1).clamp(min=1)
    seq_log_ratio = token_log_ratio.sum(-1) / lengths
    # token-level form with the same value and the paper's gradient: sg[s_i] * pi / sg[pi]
    logp = torch.where(keep, inp.logp, 0.0)
    log_ratio = logp - logp.detach() + seq_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = (token_adv.sum(-1) / lengths).unsqueeze(-1)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - inp.clip_eps_low, 1 + inp.clip_eps_high) * adv
    loss = -torch.min(surr1, surr2)
    return torch.where(keep, loss, 0.0), (surr2 < surr1) & keep


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and how an IS correction (``algo.is_correction``) enters it."""

    fn: Callable[[PolicyLossInput], tuple[torch.Tensor, torch.Tensor]]
    # with an IS correction: True, the ratio is taken against the engine's sampling log-probs, so the
    # correction sits inside the (clipped) ratio and no weights multiply the loss (GSPO's sequence ratio, as
    # OpenRLHF); False, the ratio is against the old log-probs and the correction's weights multiply each token
    corrects_in_ratio: bool = False

    def __call__(self, inp: PolicyLossInput) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(inp)

    def behaviour(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, corrected: bool) -> torch.Tensor:
        """The log-probs the ratio is taken against."""
        return rollout_logp if corrected and self.corrects_in_ratio else old_logp

    def weighted(self, corrected: bool) -> bool:
        """Whether the IS correction's weights multiply the per-token loss."""
        return corrected and not self.corrects_in_ratio


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(ppo_clip),
    "gspo": PolicyLoss(gspo, corrects_in_ratio=True),
}

def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """The critic's per-token loss, OpenRLHF's ValueLoss: ``max((clip(V) - R)^2, (V - R)^2) / 2`` with
    ``clip(V) = V_old + clamp(V - V_old, -clip, clip)``; ``(V - R)^2 / 2`` without a clip. [B, T]; zero
    where masked (aggregate it like the policy loss)."""
    keep = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(keep, values, zero)
    old, ret = torch.where(keep, old_values, zero), torch.where(keep, returns, zero)
    loss = (v - ret) ** 2
    if clip is not None:
        clipped = old + (v - old).clamp(-clip, clip)
        loss = torch.max((clipped - ret) ** 2, loss)
    return torch.where(keep, 0.5 * loss, zero)


def policy_objective(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float, *,
                     kl: torch.Tensor | None = None, kl_coef: float = 0.0, entropy: torch.Tensor | None = None,
                     entropy_coef: float | None = None) -> torch.Tensor:
    """A micro-batch's share of the policy's loss: the aggregated policy loss, plus ``kl_coef`` times the
    aggregated KL when KL is a loss term (``kl`` given), minus ``entropy_coef`` times the aggregated entropy
    (OpenRLHF's ``entropy_loss_coef``: None or 0 leaves the loss alone; the entropy is logged either way)."""
    loss = aggregate(per_token, mask, mode, normaliser)
    if kl is not None and kl_coef:
        loss = loss + kl_coef * aggregate(kl, mask, mode, normaliser)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * aggregate(entropy, mask, mode, normaliser)
    return loss


# ---------------------------------------------------------------------------------------------
# aggregation: sums over a micro-batch divided by a normaliser computed over the whole global batch,
# so the result does not depend on how the batch is split into micro-batches or ranks


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float) -> torch.Tensor:
    """Sum of a micro-batch's contribution to the global-batch loss.

    - ``token_mean``: sum of token losses / (response tokens in the global batch);
    - ``seq_mean_token_mean``: sum over sequences of (mean token loss) / (sequences in the global batch);
    - ``seq_mean_token_sum_norm``: sum of token losses / (sequences x max response length), Dr. GRPO.

    ``normaliser`` is the global count from :func:`aggregation_normaliser`.
    """
    m = mask.to(loss.dtype)
    loss = torch.where(mask.bool(), loss, 0.0)  # whatever sits at a masked position stays out
    if mode in ("token_mean", "seq_mean_token_sum_norm"):
        return loss.sum() / normaliser
    if mode == "seq_mean_token_mean":
        return (loss.sum(-1) / m.sum(-1).clamp(min=1)).sum() / normaliser
    raise ValueError(f"loss aggregation '{mode}' is unknown; valid: {', '.join(AGGREGATIONS)}")


def aggregation_normaliser(masks: list[torch.Tensor], mode: str, max_len: int) -> float:
    """The global-batch divisor for :func:`aggregate`, from the masks of every micro-batch of every rank."""
    if mode == "token_mean":
        return float(sum(m.sum().item() for m in masks))
    sequences = float(sum(m.shape[0] for m in masks))
    return sequences * max_len if mode == "seq_mean_token_sum_norm" else sequences


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


# other frameworks' names for the estimators (TRL's GRPO/Dr. GRPO loss types, the papers' names)
SYNONYMS = {"grpo": "group_norm", "dr-grpo": "dr_grpo", "ppo": "gae", "reinforce++": "reinforce",
            "reinforce_plus_plus": "reinforce", "reinforce++-baseline": "reinforce_baseline",
            "reinforce_plus_plus_baseline": "reinforce_baseline"}


def lookup(registry: dict, name: str, field: str):
    """``registry[name]``, or a ValueError naming the config ``field``, the value, a "did you mean" (also for
    another framework's name, e.g. TRL's ``grpo``) and the valid names."""
    from stages.common.cli import did_you_mean

    if name not in registry:
        synonyms = {k: v for k, v in SYNONYMS.items() if v in registry}
        raise ValueError(f"{field}: '{name}' is unknown; valid: {', '.join(sorted(registry))}{did_you_mean(name, registry, synonyms)}")
    return registry[name]


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to ``max_new_tokens - buffer`` tokens,
    then falling linearly to ``-factor`` at ``max_new_tokens``. lengths [B] -> penalty [B]."""
    expected = max_new_tokens - buffer
    return -((lengths - expected).clamp(min=0) / buffer).clamp(max=1.0) * factor


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL's stop-properly penalty (OpenRLHF's ``stop_properly_penalty_coef``) on responses that hit
    ``max_new_tokens`` without a stop token (vLLM's ``finish_reason == "length"``): ``coef`` in [0, 1] scales
    their reward, a negative ``coef`` replaces it. rewards [B], truncated [B] bool -> rewards [B]."""
    if coef >= 0:
        return torch.where(truncated, rewards * coef, rewards)
    return torch.where(truncated, torch.full_like(rewards, coef), rewards)


# ---------------------------------------------------------------------------------------------
# importance-sampling correction of the gap between the rollout engine's sampling distribution and the
# learners' (OpenRLHF's vllm_is_correction; Yao et al. 2025, "Your efficient RL framework secretly brings
# you off-policy RL training"). w = exp(log pi_old - log pi_vllm) per token, detached, multiplies the
# per-token policy loss.


@dataclass
class ISInput:
    old_logp: torch.Tensor  # [B, T] the learners' log-probs of the sampled tokens (the behaviour policy)
    rollout_logp: torch.Tensor  # [B, T] the engine's sampling log-probs of the same tokens
    mask: torch.Tensor  # [B, T]
    low: float  # algo.is_threshold
    high: float

    def log_ratio(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi_old - log pi_vllm, detached and 0 where masked; the mask as bool)."""
        keep = self.mask.bool()
        return torch.where(keep, self.old_logp - self.rollout_logp, 0.0).detach(), keep


def tis(inp: ISInput) -> torch.Tensor:
    """Truncated IS: the token ratio clamped to [low, high]."""
    log_ratio, keep = inp.log_ratio()
    return torch.where(keep, log_ratio.exp().clamp(inp.low, inp.high), 0.0)


def icepop(inp: ISInput) -> torch.Tensor:
    """IcePop: the token ratio where it lies in [low, high], 0 (the token dropped) outside."""
    log_ratio, keep = inp.log_ratio()
    w = log_ratio.exp()
    return torch.where(keep & (w >= inp.low) & (w <= inp.high), w, 0.0)


def seq_mask_tis(inp: ISInput) -> torch.Tensor:
    """Sequence-masked IS: whole sequences whose geometric-mean ratio lies outside [low, high] are dropped;
    the others' tokens keep their own (unclamped) ratio, as OpenRLHF's ``seq-mask-tis``."""
    log_ratio, keep = inp.log_ratio()
    m = keep.to(log_ratio.dtype)
    seq = (log_ratio.sum(-1) / m.sum(-1).clamp(min=1)).exp()
    seq_keep = ((seq >= inp.low) & (seq <= inp.high)).unsqueeze(-1)
    return torch.where(keep & seq_keep, log_ratio.exp(), 0.0)


IS_CORRECTIONS: dict[str, Callable[[ISInput], torch.Tensor]] = {"tis": tis, "icepop": icepop, "seq-mask-tis": seq_mask_tis}


# ---------------------------------------------------------------------------------------------
# dynamic filtering (DAPO)


def groups_in_range(scores: torch.Tensor, group_size: int, low: float, high: float) -> list[int]:
    """The groups (consecutive ``group_size`` samples of one prompt) whose mean score lies strictly inside
    (low, high), as OpenRLHF's dynamic filtering: with scores in [0, 1] and the default (0, 1), the groups
    where every sample failed or every one succeeded (no learning signal) are dropped."""
    means = scores.double().view(-1, group_size).mean(-1)
    return [g for g, m in enumerate(means.tolist()) if low < m < high]
