"""The RL stage's sampler: which prompts a step draws, their rollouts (single-turn, or an agent's episodes), their
scores, and DAPO's dynamic filtering. Two calls a step: :meth:`Sampler.start` (the engines begin; with async
training the loop starts later steps ahead) and :meth:`Sampler.collect` (wait, score, filter) -> :class:`Rollout`.

Token-in-token-out: the samples are the token ids the engines produced; the prompts are rendered once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from datasets_prep.packing import BatchSchedule
from datasets_prep.sft import render_prompt
from stages.rl.algorithms import groups_in_range
from stages.rl.config import RLConfig
from stages.rl.experience import Samples, Scores
from stages.rl.rewards import RewardSource, Timed
from stages.rl.rollout import EnginePool


@dataclass
class Rollout:
    """A step's samples and their scores, with what the sampler measured."""

    samples: Samples
    scores: Scores
    metrics: dict[str, float] = field(default_factory=dict)  # dynamic filtering's share and prompts drawn
    reward_s: float = 0.0  # seconds spent in the reward source


@dataclass
class Started:
    """A step's rollout on its way: the prompts' rows, their seed, the engines' pending calls (episodes: their
    jobs' groups too)."""

    idx: list[int]
    seed: int
    refs: list | None


class SingleTurn:
    """One response per sample, all sampled at once (a vision-language model's prompts with their rows' images)."""

    def __init__(self, engines: EnginePool, prompt_ids: list[list[int]], images: list[list[str]] | None = None):
        self.engines, self.prompt_ids, self.images = engines, prompt_ids, images

    def start(self, idx: list[int], n: int, temperature: float, seed: int, logprobs: bool) -> list:
        images = [self.images[i] for i in idx] if self.images is not None else None
        return self.engines.launch([self.prompt_ids[i] for i in idx], n, temperature, seed, logprobs, images)

    def finish(self, started: Started, rows: list[dict], data, n: int, temperature: float, logprobs: bool,
               images: list[list[str]] | None = None) -> list:
        return self.engines.gather(started.refs)


class Episodes:
    """Agent (or tools) episodes (``stages.common.agents``), every one in flight at once in the engines' processes
    (``stages.common.episodes``): started with the step, so async training samples them ahead like single-turn ones."""

    def __init__(self, engines: EnginePool, render: Callable[[Any], str], cfg: RLConfig):
        self.engines, self.render, self.cfg = engines, render, cfg

    def spec(self, temperature: float, logprobs: bool, data):
        from stages.common.episodes import Spec

        ro = self.cfg.rollout
        return Spec(ro.agent, ro.tools, ro.tool_parser, ro.max_tool_calls, ro.max_turns, ro.max_new_tokens, ro.max_model_len,
                    temperature, logprobs, ro.env_timeout_s, ro.max_concurrent_episodes, data)

    def launch(self, idx: list[int], rows: list[dict], data, n: int, temperature: float, seed: int, logprobs: bool,
               images: list[list[str]] | None = None):
        """``images``: a vision-language model's, each row's image references (their parts join the prompt)."""
        from stages.common.episodes import episode_jobs

        def render(prompt, refs):
            return self.render(Sampler.pictured(prompt, refs or [], "an episode's prompt"), data)

        groups = episode_jobs(rows, idx, data, n, seed, render, images)
        return groups, self.engines.launch_episodes(groups, self.spec(temperature, logprobs, data))

    def finish(self, started: Started, rows: list[dict], data, n: int, temperature: float, logprobs: bool,
               images: list[list[str]] | None = None) -> list:
        if started.refs is None:
            started.refs = self.launch(started.idx, rows, data, n, temperature, started.seed, logprobs, images)
        groups, refs = started.refs
        return self.engines.gather_episodes(refs, groups)


class Sampler:
    def __init__(self, cfg: RLConfig, tokenizer, engines: EnginePool, rows: list[dict], rewards: RewardSource,
                 with_logp: bool, agent=None, tools=None, images: list[list[str]] | None = None):
        """``agent``, ``tools``: the run's (``stages.rl.preflight.plugins``); with either the rollouts are episodes.
        ``images``: a vision-language model's, each row's image references (``data.image_key``)."""
        self.cfg, self.tok, self.rows, self.with_logp, self.images = cfg, tokenizer, rows, with_logp, images
        self.tool_schemas = tools.schemas if tools is not None else None
        self.rewards = Timed(rewards)
        render = self.render
        episodes = agent is not None or cfg.rollout.tools is not None
        self.kind = Episodes(engines, self.render_text, cfg) if episodes else \
            SingleTurn(engines, [render(self.pictured(r[cfg.data.prompt_key], images[i] if images else [], f"row {i + 1}"))
                                 for i, r in enumerate(rows)], images)
        self.engines = engines
        ro = cfg.rollout
        self.schedule = BatchSchedule(len(rows), ro.rollout_batch_size, ro.rollout_batch_size, 1, cfg.seed)
        # dynamic filtering's extra prompts: a schedule of its own, so the main batches stay as without filtering
        self.extra_schedule = BatchSchedule(len(rows), ro.rollout_batch_size, ro.rollout_batch_size, 1, cfg.seed + 7_919)

    @staticmethod
    def pictured(prompt, refs: list[str], where: str):
        """A row's prompt, with the parts of its images ``refs`` (``data.image_key``) when it has any."""
        if not refs:
            return prompt
        from datasets_prep.images import with_images

        return with_images(prompt, len(refs), where)

    def render(self, prompt) -> list[int]:
        return self.tok(self.render_text(prompt), add_special_tokens=False)["input_ids"]

    def render_text(self, prompt, data=None) -> str:
        """The prompt as the model sees it (with ``rollout.tools``: their schemas rendered by the chat template)."""
        return render_prompt(self.tok, prompt, data or self.cfg.data, tools=self.tool_schemas)

    def batch(self, step: int, extra: int = 0) -> tuple[list[int], int]:
        """The rows of the step's prompts (``extra`` > 0: its extra batch number ``extra``, drawn for dynamic
        filtering) and their sampling seed."""
        if extra:
            idx = self.extra_schedule.global_batch(step * self.cfg.algo.dynamic_filtering_max_batches + extra - 1)
        else:
            idx = self.schedule.global_batch(step)
        return list(idx), self.cfg.seed * 100_003 + step + extra * 1_000_033

    def start(self, step: int, extra: int = 0) -> Started:
        """Start sampling the step's prompts, ``n_samples_per_prompt`` each (with the engines' log-probs when
        the plan asks for them)."""
        ro = self.cfg.rollout
        idx, seed = self.batch(step, extra)
        if isinstance(self.kind, Episodes):
            rows = [self.rows[i] for i in idx]
            images = [self.images[i] for i in idx] if self.images is not None else None
            return Started(idx, seed, self.kind.launch(idx, rows, self.cfg.data, ro.n_samples_per_prompt, ro.temperature,
                                                       seed, self.with_logp, images))
        return Started(idx, seed, self.kind.start(idx, ro.n_samples_per_prompt, ro.temperature, seed, self.with_logp))

    def _scored(self, started: Started) -> tuple[list, Samples, Scores]:
        ro = self.cfg.rollout
        rows = [self.rows[i] for i in started.idx]
        groups = self.kind.finish(started, rows, self.cfg.data, ro.n_samples_per_prompt, ro.temperature, self.with_logp)
        samples = Samples.of(started.idx, groups, self.tok.pad_token_id, self.with_logp, self.images)
        return groups, samples, self.rewards.score(rows, samples)

    def collect(self, step: int, started: Started) -> Rollout:
        """The step's samples and their scores. With ``algo.dynamic_filtering`` (DAPO), see :meth:`filtered`."""
        self.rewards.seconds = 0.0
        groups, samples, scores = self._scored(started)
        if self.cfg.algo.dynamic_filtering is None:
            return Rollout(samples, scores, reward_s=self.rewards.seconds)
        out = self.filtered(step, started.idx, groups, scores)
        out.reward_s = self.rewards.seconds
        return out

    def filtered(self, step: int, idx: list[int], groups: list, scores: Scores) -> Rollout:
        """DAPO's dynamic filtering: the groups whose mean score lies outside the range are dropped and extra
        batches of prompts drawn (at most ``dynamic_filtering_max_batches``) until ``rollout_batch_size`` groups
        remain; the first ones are kept. Its metrics: the share of drawn groups filtered out, and how many."""
        algo, ro = self.cfg.algo, self.cfg.rollout
        n, want = ro.n_samples_per_prompt, ro.rollout_batch_size
        kept_idx, kept_groups, kept_scores, drawn = [], [], [], 0
        for extra in range(algo.dynamic_filtering_max_batches + 1):
            if extra:
                started = self.start(step, extra)
                groups, _, scores = self._scored(started)
                idx = started.idx
            drawn += len(idx)
            keep = groups_in_range(scores.scores, n, *algo.dynamic_filtering)
            kept_idx += [idx[g] for g in keep]
            kept_groups += [groups[g] for g in keep]
            kept_scores.append(scores.rows([g * n + j for g in keep for j in range(n)]))
            if len(kept_idx) >= want:
                break
        else:
            raise RuntimeError(
                f"dynamic filtering: only {len(kept_idx)} of the {drawn} prompt groups drawn at step {step + 1} have a mean "
                f"score inside algo.dynamic_filtering={list(algo.dynamic_filtering)}, fewer than rollout_batch_size={want} "
                f"after algo.dynamic_filtering_max_batches={algo.dynamic_filtering_max_batches} extra batches; widen the "
                "range, allow more extra batches, or use data the policy neither always solves nor always fails"
            )
        samples = Samples.of(kept_idx[:want], kept_groups[:want], self.tok.pad_token_id, self.with_logp, self.images)
        scores = Scores.cat(kept_scores).rows(list(range(want * n)))
        return Rollout(samples, scores, {"filtered_share": 1 - (len(kept_idx) / drawn), "prompts_drawn": float(drawn)})

    def evaluate(self, rows: list[dict], grader=None) -> dict[str, float]:
        """Greedy held-out score on ``rows`` (``eval_data``): the grader's accuracy when one is set, else the
        reward source's (an agent's episodes: their score, turns and info; a reward model: its mean score)."""
        if not rows:
            return {}
        data = self.cfg.eval_data
        started = Started(list(range(len(rows))), self.cfg.seed, None)
        images = None
        if data.image_key is not None:
            from datasets_prep.sft import row_images

            images = [row_images(r, data, f"eval row {i + 1}") for i, r in enumerate(rows)]
        if isinstance(self.kind, SingleTurn):
            prompts = [self.render(self.pictured(r[data.prompt_key], images[i] if images else [], f"eval row {i + 1}"))
                       for i, r in enumerate(rows)]
            started.refs = self.engines.launch(prompts, 1, 0.0, self.cfg.seed, images=images)
        groups = self.kind.finish(started, rows, data, 1, 0.0, False, images)
        samples = Samples.of(started.idx, groups, self.tok.pad_token_id, with_logp=False)
        if grader is not None:
            from stages.common.agents import last_answer
            from stages.common.graders import grade

            texts = [last_answer(self.tok, c) if isinstance(self.kind, Episodes) else self.tok.decode(c.token_ids, skip_special_tokens=True)
                     for c in samples.completions]  # an episode: its last answer, after its tool calls
            hits = [grade(grader, t, row[data.label_key], f"eval row {i + 1}") for i, (t, row) in enumerate(zip(texts, rows, strict=True))]
            return {"eval_accuracy": sum(hits) / len(hits)}
        return self.rewards.source.held_out(self.rewards.score(rows, samples))
