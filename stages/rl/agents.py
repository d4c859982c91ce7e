"""Multi-turn agents in RL rollouts (OpenRLHF's agent RL): the model acts, an environment answers, in turns.

A recipe names an agent file (``rollout.agent: path/to/agent.py``, or ``file.py``/``package.module``) with two
functions, OpenRLHF's ``AgentInstanceBase`` semantics in plain Python::

    def reset(prompt, label) -> (state, observation)
        # a new episode on a data row; observation: the first user turn's text, or None for the row's prompt
    def step(state, action_text) -> (observation, reward, done) or (observation, reward, done, info)
        # the model's action (its decoded text); observation: the environment's answer, appended for the next
        # turn: a str (appended as it is, tokenized) or a chat message {"role": ..., "content": ...} (rendered
        # by the tokenizer's chat template as the next turn, with the generation prompt after it)

An episode runs until ``done`` or ``rollout.max_turns`` actions (or until the context would leave fewer than
``max_new_tokens`` of ``max_model_len``). Token in, token out: the trajectory is the prompt's ids, then each
action's ids exactly as vLLM sampled them, then each observation's ids; the loss mask covers the actions only.
The episode's reward is the sum of its turns' rewards (an agent discounts by what it returns); its score (what
counts as success) is ``info["score"]`` when given, else the reward; every other number in the last ``info`` is
logged as a metric (NaN: not counted, e.g. a second-attempt rate on episodes that needed no second attempt).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stages.common.generation import Completion
from stages.common.plugins import PluginError, load_module


class AgentError(ValueError):
    """An agent file that does not load, or a reset/step answer of the wrong shape; the message names both."""


@dataclass(frozen=True)
class Agent:
    ref: str
    reset: Callable[[Any, Any], tuple[Any, Any]]
    step: Callable[[Any, str], tuple]


def load_agent(ref: str) -> Agent:
    try:
        module = load_module(ref, "rollout.agent", AgentError)
    except PluginError as e:
        raise AgentError(str(e)) from e
    funcs = {name: getattr(module, name, None) for name in ("reset", "step")}
    missing = [f"{name}{sig}" for (name, f), sig in zip(funcs.items(), ("(prompt, label)", "(state, action_text)"), strict=True)
               if not callable(f)]
    if missing:
        raise AgentError(f"rollout.agent {ref}: defines no callable {' or '.join(missing)}")
    return Agent(ref, funcs["reset"], funcs["step"])


@dataclass
class Episode(Completion):
    """A finished trajectory as a completion: ``token_ids`` is everything after the prompt, ``action_mask`` 1 on
    the model's tokens; ``logprobs`` 0.0 on the environment's."""

    reward: float = 0.0
    score: float = 0.0
    turns: int = 0
    info: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    state: Any
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    finish_reason: str | None = None
    info: dict[str, float] = field(default_factory=dict)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def act(self, action: Completion) -> None:
        """Append the model's sampled tokens as they are (in the loss)."""
        self.token_ids += action.token_ids
        self.action_mask += [1] * len(action.token_ids)
        self.logprobs += list(action.logprobs) if action.logprobs is not None else [0.0] * len(action.token_ids)
        self.finish_reason = action.finish_reason
        self.turns += 1

    def observe(self, ids: list[int]) -> None:
        """Append the environment's tokens (out of the loss)."""
        self.token_ids += ids
        self.action_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def episode(self, tokenizer, with_logprobs: bool) -> Episode:
        score = self.info.get("score", self.reward)
        info = {k: v for k, v in self.info.items() if k != "score"}
        return Episode(list(self.prompt_ids), list(self.token_ids), tokenizer.decode(self.token_ids),
                       list(self.logprobs) if with_logprobs else None, self.finish_reason, list(self.action_mask),
                       reward=self.reward, score=float(score), turns=self.turns, info=info)


class ObservationTokens:
    """An observation's token ids: a string tokenized as it is, a chat message rendered by the chat template as
    the turn after an ended assistant turn (with the generation prompt)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._heads: dict[str, str] = {}

    def __call__(self, obs: Any, where: str) -> list[int]:
        if isinstance(obs, str):
            text = obs
        elif isinstance(obs, dict) and isinstance(obs.get("content"), str) and isinstance(obs.get("role"), str):
            text = self._turn(obs)
        else:
            raise AgentError(f"{where}: the observation is {obs!r:.80}; expected a str, a chat message "
                             "{'role': ..., 'content': str} or None")
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _turn(self, message: dict) -> str:
        before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        head = self.tok.apply_chat_template(before, tokenize=False)
        full = self.tok.apply_chat_template([*before, message], tokenize=False, add_generation_prompt=True)
        if not full.startswith(head):
            raise AgentError("rollout.agent: the chat template does not render a conversation as a prefix of its "
                             "continuation; return observations as strings")
        return full[len(head):]


def check_step_answer(answer: Any, where: str) -> tuple[Any, float, bool, dict[str, float]]:
    if not isinstance(answer, tuple) or len(answer) not in (3, 4):
        raise AgentError(f"{where}: step returned {answer!r:.80}; expected (observation, reward, done) or "
                         "(observation, reward, done, info)")
    obs, reward, done = answer[:3]
    info = answer[3] if len(answer) == 4 else {}
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise AgentError(f"{where}: reward {reward!r:.40}; expected a finite number")
    if not isinstance(done, bool):
        raise AgentError(f"{where}: done {done!r:.40}; expected True or False")
    if not isinstance(info, dict) or not all(isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
                                             for k, v in info.items()):
        raise AgentError(f"{where}: info {info!r:.80}; expected a dict of metric names to numbers")
    return obs, float(reward), done, {k: float(v) for k, v in info.items()}


def run_episodes(agent: Agent, generate: Callable[[list[list[int]], int, int], list[list[Completion]]], tokenizer,
                 render: Callable[[str], list[int]], rows: list[dict], prompt_key: str, label_key: str, n: int,
                 max_turns: int, max_new_tokens: int, max_model_len: int, seed: int, with_logprobs: bool,
                 ) -> list[list[Episode]]:
    """``n`` episodes per row, as groups of :class:`Episode`.

    ``generate(prompt_ids, n, seed)`` samples ``n`` completions per context (the engines). The first turn samples
    a group's ``n`` actions from the group's prompt in one request (as single-turn rollouts do); later turns one
    action per live episode, each from its own context."""
    trajectories, prompts = [], []
    for r, row in enumerate(rows):
        prompt_ids, group = start_group(agent, row, n, render, prompt_key, label_key, f"rollout.agent {agent.ref}: reset on row {r + 1}")
        prompts.append(prompt_ids)
        trajectories.append(group)
    flat = [t for g in trajectories for t in g]
    step = Stepper(agent, tokenizer, max_turns, max_new_tokens, max_model_len)
    for turn in range(max_turns):
        live = [t for t in flat if not t.done]
        if not live:
            break
        for t, action in zip(live, actions_of(generate, live, prompts, n, seed, turn), strict=True):
            step(t, action, turn)
    return [[t.episode(tokenizer, with_logprobs) for t in g] for g in trajectories]


def actions_of(generate, live: list[Trajectory], prompts: list[list[int]], n: int, seed: int, turn: int) -> list[Completion]:
    """The live episodes' next actions: at the first turn a group's ``n`` from its prompt in one request, later one
    per episode from its own context."""
    if turn == 0:
        return [a for g in generate(prompts, n, seed) for a in g]
    return [g[0] for g in generate([t.context for t in live], 1, seed + 7_919 * turn)]


def start_group(agent: Agent, row: dict, n: int, render: Callable[[str], list[int]], prompt_key: str, label_key: str,
                where: str) -> tuple[list[int], list[Trajectory]]:
    """``n`` new episodes on ``row``, all from the prompt the first one's reset gives (the row's, or its observation)."""
    states = [reset(agent, row, prompt_key, label_key, where) for _ in range(n)]
    obs = states[0][1]
    prompt_ids = render(row[prompt_key] if obs is None else obs)
    return prompt_ids, [Trajectory(list(prompt_ids), state) for state, _ in states]


def reset(agent: Agent, row: dict, prompt_key: str, label_key: str, where: str) -> tuple[Any, Any]:
    """A new episode on ``row``: the agent's (state, first observation: the prompt's text or None)."""
    try:
        answer = agent.reset(row[prompt_key], row.get(label_key))
    except Exception as e:
        raise AgentError(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(answer, tuple) or len(answer) != 2:
        raise AgentError(f"{where}: returned {answer!r:.80}; expected (state, observation)")
    if answer[1] is not None and not isinstance(answer[1], str):
        raise AgentError(f"{where}: the first observation is {answer[1]!r:.80}; expected the prompt's text or None")
    return answer


class Stepper:
    """A turn of an episode: the model's action appended, the agent's answer taken, its observation appended
    unless the episode ends (done, the last turn, no observation, or no room left for another whole action)."""

    def __init__(self, agent: Agent, tokenizer, max_turns: int, max_new_tokens: int, max_model_len: int):
        self.agent, self.tok, self.tokens = agent, tokenizer, ObservationTokens(tokenizer)
        self.max_turns, self.max_new_tokens, self.max_model_len = max_turns, max_new_tokens, max_model_len

    def __call__(self, t: Trajectory, action: Completion, turn: int) -> None:
        t.act(action)
        where = f"rollout.agent {self.agent.ref}: step {turn + 1}"
        try:
            answer = self.agent.step(t.state, self.tok.decode(action.token_ids, skip_special_tokens=True))
        except Exception as e:
            raise AgentError(f"{where} raised {type(e).__name__}: {e}") from e
        obs, reward, done, info = check_step_answer(answer, where)
        t.reward += reward
        t.info = info or t.info
        if done or turn + 1 == self.max_turns or obs is None:
            t.done = True
            return
        ids = self.tokens(obs, where)
        if len(t.context) + len(ids) + self.max_new_tokens > self.max_model_len:  # no room for another whole action
            t.done = True
            return
        t.observe(ids)
