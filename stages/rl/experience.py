"""The RL step's typed experience pipeline: what a step needs, its samples, its experience, its updates.

One step (``stages.rl.driver.RLLoop.run``) is a short list of calls over these types::

    samples    = loop.rollout(step)                      # vLLM: token ids in and out        -> Samples
    scored     = loop.score(samples)                     # reward source                     -> Scores
    forward    = loop.forward(samples)                   # learners and critic, no grad      -> Forward
    experience = make_experience(plan, cfg, samples, scored, forward, kl)   # pure function  -> Experience
    metrics    = loop.update(experience, step)           # critic and policy updates (updates_of)
    loop.sync(probe)                                     # push and verify the weights

What a step needs is decided once, from the config, in :class:`StepPlan`: whether the learners compute
old (behaviour) log-probs, whether there is a reference, whether a critic gives values, whether vLLM
reports its sampling log-probs. Every optional field below is None exactly when the plan says so; nothing
downstream tests for a key to decide what to do. Estimators, losses and penalties live in
``stages.rl.algorithms`` registries; adding one does not touch the loop. KL bookkeeping (the fixed or
adaptive coefficient) is :class:`KLController`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from stages.rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    AdvantageInput,
    aggregation_normaliser,
    overlong_penalty,
    stop_properly_penalty,
)
from stages.rl.config import RLConfig


@dataclass(frozen=True)
class StepPlan:
    """What every step of a run needs, decided once from the config."""

    old_logp: bool  # the learners compute the behaviour policy's log-probs (else: on-policy, one update)
    ref_logp: bool  # a frozen reference gives log-probs (init_kl_coef > 0)
    values: bool  # a critic gives values (PPO with GAE)
    rollout_logp: bool  # vLLM reports its sampling log-probs (compared with the old ones; IS correction)
    kl_in_reward: bool  # KL shapes the per-token reward (else, with a reference, it is a loss term)

    @classmethod
    def of(cls, cfg: RLConfig) -> StepPlan:
        algo, ro = cfg.algo, cfg.rollout
        ref = algo.init_kl_coef > 0
        kl_reward = ref and algo.kl_in_reward
        samples = ro.rollout_batch_size * ro.n_samples_per_prompt
        # one optimizer step per rollout, one epoch: the policy that sampled is the one being updated
        on_policy = algo.ppo_epochs == 1 and samples == cfg.train.train_batch_size and not kl_reward
        return cls(old_logp=not on_policy, ref_logp=ref, values=ADVANTAGE_ESTIMATORS[algo.advantage_estimator].needs_critic,
                   rollout_logp=not on_policy or algo.is_correction is not None or ro.async_, kl_in_reward=kl_reward)

    @property
    def kl_loss(self) -> bool:
        return self.ref_logp and not self.kl_in_reward


@dataclass
class Samples:
    """A step's rollouts: ``n_samples_per_prompt`` consecutive samples per prompt, padded on the right."""

    prompt_index: list[int]  # [P] rows of the data, one per group
    prompt_ids: list[list[int]]  # [B]
    response_ids: list[list[int]]  # [B] exactly as vLLM sampled them
    texts: list[str]  # [B]
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] 1 on response tokens the model sampled (an agent's environment tokens: 0)
    rollout_logp: torch.Tensor | None  # [B, T] vLLM's sampling log-probs at response positions (plan.rollout_logp)
    truncated: torch.Tensor  # [B] bool: the response hit max_new_tokens without a stop token (finish_reason "length")
    completions: list[Any] = field(default_factory=list)  # [B] what the engines (or an agent's episodes) returned
    images: list[list[str]] | None = None  # [B] a vision-language model's: each sample's image references, in order

    @classmethod
    def of(cls, prompt_index: list[int], groups: list[list[Any]], pad_id: int, with_logp: bool,
           images: list[list[str]] | None = None) -> Samples:
        """``images``: a vision-language model's, each data row's image references (an episode's completion carries
        its own: the prompt's and its environment's)."""
        flat = [c for group in groups for c in group]
        width = max(len(c.prompt_ids) + len(c.token_ids) for c in flat)
        b = len(flat)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        resp = torch.zeros((b, width), dtype=torch.long)
        logp = torch.zeros((b, width), dtype=torch.float32) if with_logp else None
        for i, c in enumerate(flat):
            p, r = len(c.prompt_ids), len(c.token_ids)
            ids[i, : p + r] = torch.tensor(c.prompt_ids + c.token_ids)
            attn[i, : p + r] = 1
            resp[i, p : p + r] = 1 if c.action_mask is None else torch.tensor(c.action_mask)
            if logp is not None:
                logp[i, p : p + r] = torch.tensor(c.logprobs)
        truncated = torch.tensor([c.finish_reason == "length" for c in flat], dtype=torch.bool)
        seen = None if images is None else _sample_images(prompt_index, groups, images)
        return cls(prompt_index, [list(c.prompt_ids) for c in flat], [list(c.token_ids) for c in flat],
                   [c.text for c in flat], ids, attn, resp, logp, truncated, flat, seen)

    def tensors(self) -> dict[str, Any]:
        """What a forward pass needs (a vision-language model's samples: each one's image references too, a list
        sliced with the rows)."""
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "response_mask": self.response_mask}
        return out if self.images is None else {**out, "images": self.images}


def _sample_images(prompt_index: list[int], groups: list[list[Any]], images: list[list[str]]) -> list[list[str]]:
    """Each sample's image references: an episode's own (the prompt's and its environment's), else its row's."""
    return [list(c.images) if getattr(c, "images", None) is not None else list(images[i])
            for i, g in zip(prompt_index, groups, strict=True) for c in g]


@dataclass
class Scores:
    """The reward source's answer (OpenRLHF's contract) for every sample, in order."""

    rewards: torch.Tensor  # [B] what drives the advantages
    scores: torch.Tensor  # [B] what the task counts as success
    extra_logs: dict[str, torch.Tensor]

    @classmethod
    def of(cls, result: dict[str, Any]) -> Scores:
        return cls(result["rewards"], result["scores"], result.get("extra_logs") or {})

    def rows(self, index: list[int]) -> Scores:
        return Scores(self.rewards[index], self.scores[index], {k: v[index] for k, v in self.extra_logs.items()})

    @staticmethod
    def cat(parts: list[Scores]) -> Scores:
        keys = [k for k in parts[0].extra_logs if all(k in p.extra_logs for p in parts)]
        return Scores(torch.cat([p.rewards for p in parts]), torch.cat([p.scores for p in parts]),
                      {k: torch.cat([p.extra_logs[k] for p in parts]) for k in keys})


@dataclass
class Forward:
    """No-grad forward passes over the samples, as the plan asks."""

    old_logp: torch.Tensor | None  # [B, T] behaviour policy (plan.old_logp)
    ref_logp: torch.Tensor | None  # [B, T] reference (plan.ref_logp)
    values: torch.Tensor | None  # [B, T] critic, V of the state before each token (plan.values)


@dataclass
class Experience:
    """Samples with everything the updates train on."""

    samples: Samples
    scores: Scores
    forward: Forward
    kl: torch.Tensor | None  # [B, T] per-token KL to the reference (zero off the response), when there is one
    shaped: torch.Tensor  # [B] the sequence rewards after penalties, before baselines
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor  # [B, T] (the critic's targets with GAE)


class KLController:
    """The KL coefficient: fixed, or adaptive toward ``kl_target`` (Ziegler et al. 2019), as OpenRLHF."""

    def __init__(self, init: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, mean_kl: float, n_samples: int) -> None:
        if self.target is None:
            return
        err = max(min(mean_kl / self.target - 1, 0.2), -0.2)
        self.value *= 1 + err * n_samples / self.horizon


def make_experience(plan: StepPlan, cfg: RLConfig, samples: Samples, scored: Scores, forward: Forward,
                    kl_coef: float) -> Experience:
    """Rewards shaped (overlong penalty, stop-properly penalty, then in the estimator reward clip and KL),
    advantages and returns. Pure: no actors involved."""
    algo, ro = cfg.algo, cfg.rollout
    mask = samples.response_mask.float()
    kl = None
    if plan.ref_logp and forward.old_logp is not None:  # on-policy with KL as a loss: measured by the learners
        kl = torch.where(mask.bool(), KL_ESTIMATORS[algo.kl_estimator](forward.old_logp, forward.ref_logp), 0.0)
    shaped = scored.rewards.double()
    if algo.overlong_buffer:
        shaped = shaped + overlong_penalty(mask.sum(-1), ro.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty).double()
    if algo.stop_properly_penalty is not None:
        shaped = stop_properly_penalty(shaped, samples.truncated, algo.stop_properly_penalty)
    inp = AdvantageInput(shaped.float(), mask, ro.n_samples_per_prompt, kl=kl if plan.kl_in_reward else None,
                         kl_coef=kl_coef, gamma=algo.gamma, reward_clip=algo.reward_clip, values=forward.values,
                         lambd=algo.lambd)
    advantages, returns = ADVANTAGE_ESTIMATORS[algo.advantage_estimator](inp)
    return Experience(samples, scored, forward, kl, shaped, advantages.float(), returns.float())


@dataclass
class TrainBatch:
    """One rank's share of one optimizer step: what the policy and the critic train on."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_logp: torch.Tensor | None  # None exactly when on-policy (plan.old_logp False): the current log-probs are
    ref_logp: torch.Tensor | None  # plan.ref_logp
    old_values: torch.Tensor | None  # plan.values
    rollout_logp: torch.Tensor | None  # plan.rollout_logp: vLLM's sampling log-probs (IS correction)
    normaliser: float  # the loss aggregation's divisor over the whole optimizer step (all ranks)
    micro: tuple[tuple[int, int], ...] = ()  # the micro-batches' row ranges, in order (see micro_batches)
    images: list[list[str]] | None = None  # [b] a vision-language model's: each row's image references

    def _map(self, fn, rows=None) -> TrainBatch:
        """The same batch with ``fn`` applied to every tensor field (the None ones stay None); ``rows``: the
        rows kept, in order, of the per-row list ``images`` (unset: it stays as it is)."""
        out = replace(self, **{f.name: fn(v) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)})
        if rows is not None and self.images is not None:
            out.images = [self.images[i] for i in rows]
        return out

    def rows(self, start: int, stop: int) -> TrainBatch:
        return self._map(lambda t: t[start:stop], range(self.size)[start:stop])

    def to(self, device: torch.device) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def sorted_by_length(self) -> TrainBatch:
        order = torch.argsort(self.attention_mask.sum(-1), descending=True, stable=True)
        return self._map(lambda t: t[order], order.tolist())

    def trimmed(self) -> TrainBatch:
        """The batch without the padding columns every row shares (rows are right-padded)."""
        width = used_width(self.attention_mask)
        return self._map(lambda t: t[:, :width] if t.dim() == 2 else t)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def used_width(attention_mask: torch.Tensor) -> int:
    """The longest row of a right-padded batch."""
    return int(attention_mask.sum(-1).max()) if attention_mask.numel() else 0


def micro_batches(lengths: list[int], rows: int | None, max_tokens: int | None, count: int | None = None) -> list[tuple[int, int]]:
    """Row ranges of the micro-batches of a share whose rows are sorted longest first: ``rows`` rows each,
    or, with ``max_tokens``, as many rows as fit in ``max_tokens`` positions (rows x the first row's length;
    one row at least). ``count`` (>= the ranges found) splits the largest ranges until there are that many."""
    n = len(lengths)
    if max_tokens is None:
        ranges = [(i, min(i + rows, n)) for i in range(0, n, rows)]
    else:
        ranges, start = [], 0
        while start < n:
            stop = start + max(1, min(n - start, max_tokens // max(1, lengths[start])))
            ranges.append((start, stop))
            start = stop
    while count is not None and len(ranges) < count:
        i = max(range(len(ranges)), key=lambda k: (ranges[k][1] - ranges[k][0]) * lengths[ranges[k][0]])
        a, b = ranges[i]
        if b - a < 2:
            raise ValueError(f"cannot cut {n} rows into {count} micro-batches")
        ranges[i : i + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return ranges


def updates_of(exp: Experience, cfg: RLConfig, n_ranks: int) -> list[list[TrainBatch]]:
    """The step's samples as optimizer steps (``train_batch_size`` samples each) split into rank shares:
    ``[rank][update]``. The normaliser of each optimizer step is computed over all of it. With
    ``train.max_tokens_per_micro_batch`` each share is sorted longest first and cut by tokens, every rank
    into as many micro-batches as the rank that needs most (its forwards are collective under ZeRO-3)."""
    s, f = exp.samples, exp.forward
    whole = TrainBatch(s.input_ids, s.attention_mask, s.response_mask, exp.advantages, exp.returns,
                       f.old_logp, f.ref_logp, f.values, s.rollout_logp, 0.0, images=s.images)
    tb = cfg.train.train_batch_size
    per_rank: list[list[TrainBatch]] = [[] for _ in range(n_ranks)]
    for start in range(0, whole.size, tb):
        chunk = whole.rows(start, start + tb)
        norm = aggregation_normaliser([chunk.response_mask], cfg.algo.loss_agg, cfg.rollout.max_new_tokens)
        size = chunk.size // n_ranks
        shares = [chunk.rows(r * size, (r + 1) * size) for r in range(n_ranks)]
        budget = cfg.train.max_tokens_per_micro_batch
        if budget is not None:
            shares = [share.sorted_by_length() for share in shares]
        lengths = [share.attention_mask.sum(-1).tolist() for share in shares]
        plans = [micro_batches(n, cfg.train.micro_train_batch_size, budget) for n in lengths]
        count = max(len(p) for p in plans)
        for r, share in enumerate(shares):
            micro = micro_batches(lengths[r], cfg.train.micro_train_batch_size, budget, count)
            per_rank[r].append(replace(share, normaliser=norm, micro=tuple(micro)))
    return per_rank
