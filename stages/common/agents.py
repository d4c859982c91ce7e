"""Multi-turn agents in RL rollouts and eval: the model acts, an environment (and its tools) answer, in turns.

``rollout.agent`` names a file (or module) in one of two shapes.

**OpenRLHF's classes** (a file written for OpenRLHF runs after changing its import line to this module)::

    from stages.common.agents import AgentInstanceBase, MultiTurnAgentExecutor

    class AgentInstance(AgentInstanceBase):        # one per episode
        async def reset(self, states):             # {"observation": the prompt's text, "label": ...}
            return {"observation": states["observation"]}
        async def step(self, states):              # {"observation_text", "action_text", "label", "sampling_params"}
            return {"rewards": r, "scores": s, "environment_feedback": text, "done": d,
                    "sampling_params": states["sampling_params"], "extra_logs": {...}}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

or an ``AgentExecutor(AgentExecutorBase)`` whose ``async execute(prompt, label, sampling_params, max_length,
hf_tokenizer, llm_engine, images=None)`` runs a whole episode, awaiting ``llm_engine.generate(token_ids,
sampling_params)`` (a vLLM ``RequestOutput``) for each action, and returns OpenRLHF's dict
(``observation_tokens``, ``action_ranges``, ``rollout_log_probs``, ``reward``, ``scores``, ``extra_logs``).
Semantics as OpenRLHF's: the episode's reward is the sum of its steps' ``rewards``, its score the last step's
``scores`` (default: that sum), the last step's ``extra_logs`` are logged, ``environment_feedback`` is appended
to the context as text (here also a chat message ``{"role", "content"}``, rendered by the chat template), a
step's ``sampling_params`` sample the next action. Numbers may be floats, ints, one-element lists or tensors.

**Two functions** (sync or ``async def``)::

    def reset(prompt, label) -> (state, observation)   # observation: the first user turn's text, or None
    def step(state, action_text) -> (observation, reward, done) or (observation, reward, done, info)

an observation being a str (appended as it is) or a chat message; ``info["score"]`` the score (default: the
summed rewards), the rest of the last ``info`` logged (NaN: not counted).

Either way an episode runs until done, ``rollout.max_turns`` actions, or until the context would leave fewer than
``max_new_tokens`` of ``max_model_len`` (the feedback after the last action is not appended). Token in, token
out: the trajectory is the prompt's ids, each action's ids exactly as vLLM sampled them, each observation's ids;
the loss covers the actions only. Every episode is its own coroutine (``stages.common.episodes``); every environment
call (reset, step, a tool) is awaited under ``rollout.env_timeout_s``; sync ones run in a thread pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass, field
from typing import Any

from stages.common.generation import Completion
from stages.common.plugins import PluginError, load_module


class AgentError(ValueError):
    """An agent file that does not load, or a reset/step answer of the wrong shape; the message names both."""


class EnvironmentTimeout(AgentError):
    """An environment call (reset, step, a tool) gave no answer within ``rollout.env_timeout_s``."""


# OpenRLHF's contract (openrlhf.utils.agent), the same names and signatures


class AgentInstanceBase(ABC):
    """One episode's environment: ``reset`` once, then ``step`` after every action (OpenRLHF's AgentInstanceBase)."""

    def __init__(self, *args, **kwargs):  # noqa: B027  (OpenRLHF's is abstract; an instance without one is accepted here)
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """Runs one whole episode against an engine handle (OpenRLHF's AgentExecutorBase)."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None) -> dict:
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


class MultiTurnAgentExecutor(AgentExecutorBase):
    """A new ``agent_instance_cls()`` per episode, driven turn by turn (:func:`run_episode`)."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise AgentError(f"MultiTurnAgentExecutor({agent_instance_cls!r:.60}): AgentInstance must inherit from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None) -> dict:
        return await run_episode(self.agent_instance_cls(), prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                                 images)


class FunctionAgent(AgentInstanceBase):
    """The functional form (``reset(prompt, label)``, ``step(state, action_text)``) as an agent instance."""

    def __init__(self, reset, step, prompt):
        self._reset, self._step, self._prompt, self.state = reset, step, prompt, None

    async def reset(self, states: dict, **kwargs):
        answer = await call(self._reset, self._prompt, states["label"])
        if not isinstance(answer, tuple) or len(answer) != 2:
            raise AgentError(f"returned {answer!r:.80}; expected (state, observation)")
        self.state, obs = answer
        if obs is not None and not isinstance(obs, str):
            raise AgentError(f"the first observation is {obs!r:.80}; expected the prompt's text or None")
        return {"observation": states["observation"] if obs is None else states["render"](obs)}

    async def step(self, states: dict, **kwargs) -> dict:
        obs, reward, done, info = check_step_answer(await call(self._step, self.state, states["action_text"]), "")
        out = {"rewards": reward, "environment_feedback": obs, "done": done or obs is None,
               "extra_logs": {k: v for k, v in info.items() if k != "score"}}
        if "score" in info:
            out["scores"] = info["score"]
        return out


class FunctionAgentExecutor(AgentExecutorBase):
    def __init__(self, reset, step):
        self.reset, self.step = reset, step

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None) -> dict:
        instance = FunctionAgent(self.reset, self.step, getattr(llm_engine, "raw_prompt", prompt))
        return await run_episode(instance, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)


@dataclass(frozen=True)
class Agent:
    """An agent file, loaded: ``executor()`` makes the executor its episodes run with."""

    ref: str
    kind: str  # "executor" (an AgentExecutor class), "instance" (an AgentInstance class), "functions"
    executor: Callable[[], AgentExecutorBase]


def load_agent(ref: str) -> Agent:
    """The agent a file or module defines: an ``AgentExecutor`` class, else an ``AgentInstance`` class, else
    ``reset``/``step`` functions; anything else is refused naming the shapes accepted."""
    try:
        module = load_module(ref, "rollout.agent", AgentError)
    except PluginError as e:
        raise AgentError(str(e)) from e
    executor, instance = getattr(module, "AgentExecutor", None), getattr(module, "AgentInstance", None)
    if executor is not None:
        if not (isinstance(executor, type) and issubclass(executor, AgentExecutorBase)):
            raise AgentError(f"rollout.agent {ref}: AgentExecutor must inherit from AgentExecutorBase (or MultiTurnAgentExecutor) "
                             f"of {__name__}; an OpenRLHF file needs its import line changed to `from {__name__} import ...`")
        return Agent(ref, "executor", executor)
    if instance is not None:
        if not (isinstance(instance, type) and issubclass(instance, AgentInstanceBase)):
            raise AgentError(f"rollout.agent {ref}: AgentInstance must inherit from AgentInstanceBase of {__name__}")
        return Agent(ref, "instance", lambda: MultiTurnAgentExecutor(instance))
    funcs = {name: getattr(module, name, None) for name in ("reset", "step")}
    missing = [f"{name}{sig}" for (name, f), sig in zip(funcs.items(), ("(prompt, label)", "(state, action_text)"), strict=True)
               if not callable(f)]
    if missing:
        raise AgentError(f"rollout.agent {ref}: defines no AgentExecutor or AgentInstance class (OpenRLHF's shape) and no "
                         f"callable {' or '.join(missing)}")
    return Agent(ref, "functions", lambda: FunctionAgentExecutor(funcs["reset"], funcs["step"]))


# the episode loop


@dataclass
class EpisodeSettings:
    """What bounds an episode (the rollout config's), and its environment's deadline and thread pool."""

    max_turns: int = 1_000_000
    max_new_tokens: int | None = None  # None: the sampling params' max_tokens
    env_timeout_s: float | None = None
    tools: Any = None  # stages.common.tools.Tools
    parser: Callable[[str], list] | None = None
    max_tool_calls: int = 0
    pool: Any = None  # a ThreadPoolExecutor for sync environment calls (None: asyncio's default)
    where: str = "rollout.agent"
    vision: str | None = None  # a vision-language policy's folder (its processor expands the images)
    max_images: int | None = None  # the most images an episode may hold (data.max_images_per_prompt)


async def call(fn, *args, timeout_s: float | None = None, what: str = ""):
    """``fn(*args)``, awaited: a coroutine function directly, a sync function in the current episode's thread
    pool; under ``timeout_s`` (:class:`EnvironmentTimeout` names ``what``)."""
    settings = _CURRENT.get(None)
    if inspect.iscoroutinefunction(fn):
        aw = fn(*args)
    else:
        aw = asyncio.get_running_loop().run_in_executor(settings.pool if settings else None, fn, *args)
    try:
        result = await asyncio.wait_for(aw, timeout_s) if timeout_s else await aw
    except TimeoutError:
        raise EnvironmentTimeout(f"{what} gave no answer within {timeout_s:g} s (rollout.env_timeout_s)") from None
    if inspect.isawaitable(result):  # a sync function that returned a coroutine
        result = await (asyncio.wait_for(result, timeout_s) if timeout_s else result)
    return result


_CURRENT: contextvars.ContextVar[EpisodeSettings] = contextvars.ContextVar("episode_settings")


async def run_episode(instance: AgentInstanceBase | None, prompt: str, label, sampling_params, max_length: int, tok,
                      engine, images: list[str] | None = None) -> dict:
    """One episode (OpenRLHF's ``MultiTurnAgentExecutor.execute`` loop, with tools and this project's bounds):
    ``instance`` None runs a tools-only episode (it ends when the model answers without a call; the reward
    function scores it). ``images``: a vision-language model's prompt images (references, one image token each in
    ``prompt``); a step's ``environment_images`` join them. Returns OpenRLHF's episode dict (with ``finish_reason``
    and ``images``, every image of the episode; ``reward`` None without an agent)."""
    s: EpisodeSettings = getattr(engine, "settings", None) or EpisodeSettings()
    token = _CURRENT.set(s)
    try:
        return await _episode(instance, prompt, label, sampling_params, max_length, tok, engine, s, list(images or []))
    finally:
        _CURRENT.reset(token)


@dataclass
class _Trajectory:
    """An episode's tokens so far: the actions' spans, the engine's log-probs (0.0 off the actions), the rewards."""

    ids: list[int]
    images: list[str] = field(default_factory=list)  # one image token each in ids, in order
    ranges: list[tuple[int, int]] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: str | None = None
    total: float = 0.0
    score: float | None = None
    extra: dict = field(default_factory=dict)
    opened: dict = field(default_factory=dict)  # the pictures opened so far, by reference

    def act(self, out, logprobs: bool) -> None:
        """Append an action's tokens as sampled (and their log-probs when asked for)."""
        start = len(self.ids)
        self.ids += list(out.token_ids)
        self.ranges.append((start, len(self.ids)))
        if logprobs and out.logprobs is not None:
            self.logps += [0.0] * (start - len(self.logps)) + [d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=True)]
        self.finish = out.finish_reason

    def length(self, s: EpisodeSettings) -> int:
        """The context's length as the model sees it (a vision-language model's images expanded)."""
        if not self.images:
            return len(self.ids)
        from stages.common.vision import expanded_length

        return expanded_length(self.ids, self.images, s.vision)

    def multi_modal_data(self) -> dict | None:
        """The pictures for vLLM, each opened once per episode."""
        from datasets_prep.images import open_image

        for r in self.images:
            if r not in self.opened:
                self.opened[r] = open_image(r)
        return {"image": [self.opened[r] for r in self.images]} if self.images else None

    def scored(self, result: dict) -> None:
        """A step's answer: its rewards summed, its scores (default the sum) and extra_logs the last ones."""
        self.total += result["rewards"]
        self.score = result.get("scores", self.total)
        self.extra = result["extra_logs"]


async def _first_observation(instance, prompt: str, label, engine, s: EpisodeSettings) -> str:
    if instance is None:
        return prompt
    states = {"observation": prompt, "label": label, "render": getattr(engine, "render", lambda p: p)}
    answer = await _env(instance.reset, states, s, f"{s.where}: reset")
    if not isinstance(answer, dict) or not isinstance(answer.get("observation"), str):
        raise AgentError(f"{s.where}: reset returned {answer!r:.80}; expected {{'observation': str}}")
    return answer["observation"]


async def _answer(instance, tools, t: _Trajectory, states: dict, s: EpisodeSettings, turn: int):
    """What answers an action: ``(feedback, its images, the next action's sampling params)``, feedback None when the
    episode ends. Tool calls are answered by the tools (beyond ``max_tool_calls``: the end); an action without calls
    by the agent's step (its reward counted in ``t``), or, without an agent, it ends the episode."""
    calls = tools.parse(states["action_text"]) if tools is not None else []
    params = states["sampling_params"]
    if calls:
        return (await tools.answer(calls, s, f"{s.where}: turn {turn}") if tools.allowed(calls) else None), None, params
    if instance is None:
        return None, None, params
    result = check_step_result(await _env(instance.step, states, s, f"{s.where}: step {turn}"), f"{s.where}: step {turn}")
    t.scored(result)
    if result.get("sampling_params") is not None:
        params = result["sampling_params"]
    if result["done"]:
        return None, None, params
    return result.get("environment_feedback") or "", result.get("environment_images"), params


def check_images(ids: list[int], images: list[str], tok, s: EpisodeSettings, where: str) -> None:
    """A vision-language model's context: one image token per image; no images for a text model; at most
    ``data.max_images_per_prompt`` of them."""
    if s.vision is None:
        if images:
            raise AgentError(f"{where}: {len(images)} images for a policy that is not a vision-language model")
        return
    from stages.common.vision import load_processor

    token = load_processor(s.vision).image_token
    count = ids.count(tok.convert_tokens_to_ids(token))
    if count != len(images):
        raise AgentError(f"{where}: {count} image tokens ({token}) for {len(images)} images; put one {token} (or a "
                         "{'type': 'image'} part of a message) where each image goes")
    if s.max_images is not None and len(images) > s.max_images:
        raise AgentError(f"{where}: the episode now holds {len(images)} images, more than data.max_images_per_prompt="
                         f"{s.max_images}")


async def _episode(instance, prompt, label, sampling_params, max_length, tok, engine, s: EpisodeSettings, images: list[str]) -> dict:
    from stages.common.tools import ToolCalls

    max_new = s.max_new_tokens or sampling_params.max_tokens
    observation_text = await _first_observation(instance, prompt, label, engine, s)
    t = _Trajectory(tok(observation_text, add_special_tokens=False)["input_ids"], images)
    check_images(t.ids, t.images, tok, s, f"{s.where}: the prompt")
    if t.length(s) + max_new > max_length:
        raise AgentError(f"{s.where}: the prompt has {t.length(s)} tokens; with max_new_tokens={max_new} that is more than "
                         f"max_model_len={max_length}")
    params = sampling_params
    tools = ToolCalls(s.tools, s.parser, s.max_tool_calls) if s.tools is not None else None
    for turn in range(1, s.max_turns + 1):
        p = copy(params)
        p.max_tokens = min(max_new, max_length - t.length(s))
        out = (await engine.generate(list(t.ids), p, t.multi_modal_data())).outputs[0]
        t.act(out, p.logprobs is not None)
        states = {"observation_text": observation_text, "action_text": out.text, "label": label, "sampling_params": params}
        feedback, shown, params = await _answer(instance, tools, t, states, s, turn)
        if feedback is None:
            break
        where = f"{s.where}: turn {turn}"
        fb, shown = feedback_ids(tok, feedback, where), feedback_images(feedback, shown, where)
        check_images(t.ids + fb, t.images + shown, tok, s, where)
        grown = _Trajectory(t.ids + fb, t.images + shown)
        if turn == s.max_turns or grown.length(s) + max_new > max_length:  # no room for another whole action
            break
        observation_text += out.text + (feedback if isinstance(feedback, str) else tok.decode(fb))
        t.ids, t.images = grown.ids, grown.images
    agent = instance is not None
    return {"prompt": prompt, "label": label, "observation_tokens": t.ids, "action_ranges": t.ranges, "images": t.images,
            "rollout_log_probs": t.logps + [0.0] * (len(t.ids) - len(t.logps)) if t.logps else None,
            "reward": t.total if agent else None, "scores": (t.total if t.score is None else t.score) if agent else None,
            "extra_logs": {**t.extra, **tools.logs()} if tools is not None else t.extra, "finish_reason": t.finish}


def feedback_images(feedback: Any, environment_images: Any, where: str) -> list[str]:
    """An observation's images as references: a step's ``environment_images`` (OpenRLHF's: PIL images, paths,
    bytes, base64 or data: URIs), else the ``"image"`` values of a chat message's ``{"type": "image"}`` parts."""
    from datasets_prep.images import image_refs
    from datasets_prep.loading import DataError

    values = environment_images
    if values is None:
        messages = feedback if isinstance(feedback, list) else [feedback] if isinstance(feedback, dict) else []
        values = [p["image"] for m in messages if isinstance(m.get("content"), list)
                  for p in m["content"] if isinstance(p, dict) and p.get("type") == "image" and p.get("image") is not None]
    try:
        return image_refs({"environment_images": values}, "environment_images", where)
    except DataError as e:
        raise AgentError(str(e)) from None


async def _env(method, states: dict, s: EpisodeSettings, what: str):
    try:
        return await call(method, states, timeout_s=s.env_timeout_s, what=what)
    except AgentError as e:
        if str(e).startswith(what):
            raise
        raise type(e)(f"{what}: {str(e).lstrip(': ')}") from e
    except Exception as e:
        raise AgentError(f"{what} raised {type(e).__name__}: {e}") from e


def feedback_ids(tok, feedback: Any, where: str) -> list[int]:
    """An observation's token ids: a string tokenized as it is, a chat message (or a list of them) rendered by the
    chat template as the turn(s) after an ended assistant turn, with the generation prompt."""
    if isinstance(feedback, str):
        text = feedback
    elif isinstance(feedback, dict | list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str | list)
                                                    for m in (feedback if isinstance(feedback, list) else [feedback])):
        text = continuation(tok, [_templated(m) for m in (feedback if isinstance(feedback, list) else [feedback])])
    else:
        raise AgentError(f"{where}: the observation is {feedback!r:.80}; expected a str, a chat message "
                         "{'role': ..., 'content': str or a list of parts} or None")
    return tok(text, add_special_tokens=False)["input_ids"]


def _templated(message: dict) -> dict:
    """A message as the chat template takes it: its image parts without their images (those travel apart)."""
    content = message["content"]
    if not isinstance(content, list):
        return message
    return {**message, "content": [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]}


def continuation(tok, messages: list[dict]) -> str:
    """The text the chat template renders for ``messages`` after an ended assistant turn, with the generation
    prompt after it (a tool's answers, a user's next turn)."""
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    head = tok.apply_chat_template(before, tokenize=False)
    full = tok.apply_chat_template([*before, *messages], tokenize=False, add_generation_prompt=True)
    if not full.startswith(head):
        raise AgentError("rollout.agent: the chat template does not render a conversation as a prefix of its "
                         "continuation; return observations as strings")
    return full[len(head):]


def number(value: Any, what: str, where: str, nan_ok: bool = False) -> float:
    """A float from what OpenRLHF accepts: an int or float, a one-element tensor, array or list."""
    v = value
    if hasattr(v, "detach"):
        v = v.detach().cpu()
    if hasattr(v, "tolist"):
        v = v.tolist()
    while isinstance(v, list | tuple) and len(v) == 1:
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int | float) or (not nan_ok and not math.isfinite(v)):
        raise AgentError(f"{where}: {what} {value!r:.40}; expected a finite number (a float, an int or a one-element tensor)")
    return float(v)


def check_step_result(result: Any, where: str) -> dict:
    """An AgentInstance's step answer, checked, its numbers as floats."""
    if not isinstance(result, dict) or "rewards" not in result or "done" not in result:
        raise AgentError(f"{where}: returned {result!r:.80}; expected a dict with 'rewards', 'done' (and "
                         "'environment_feedback', 'scores', 'extra_logs', 'sampling_params')")
    out = dict(result)
    out["rewards"] = number(result["rewards"], "rewards", where)
    if result.get("scores") is not None:
        out["scores"] = number(result["scores"], "scores", where)
    else:
        out.pop("scores", None)
    done = result["done"]
    if hasattr(done, "item"):
        done = done.item()
    if not isinstance(done, bool):
        raise AgentError(f"{where}: done {result['done']!r:.40}; expected True or False")
    out["done"] = done
    logs = result.get("extra_logs") or {}
    if not isinstance(logs, dict):
        raise AgentError(f"{where}: extra_logs {logs!r:.80}; expected a dict of metric names to numbers")
    out["extra_logs"] = {str(k): number(v, f"extra_logs[{k!r}]", where, nan_ok=True) for k, v in logs.items()}
    return out


def check_step_answer(answer: Any, where: str) -> tuple[Any, float, bool, dict[str, float]]:
    """A functional agent's step answer: (observation, reward, done[, info])."""
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


@dataclass
class Episode(Completion):
    """A finished trajectory as a completion: ``token_ids`` is everything after the prompt, ``action_mask`` 1 on
    the model's tokens; ``logprobs`` 0.0 on the environment's. ``reward`` None: the reward function scores it
    (a tools-only episode)."""

    reward: float | None = 0.0
    score: float = 0.0
    turns: int = 0
    info: dict[str, float] = field(default_factory=dict)
    images: list[str] | None = None  # a vision-language model's: every image the episode held, in order


def last_answer(tokenizer, episode: Episode) -> str:
    """The text of an episode's last action (the model's answer after its tool calls), special tokens skipped."""
    last: list[int] = []
    for t, m in zip(episode.token_ids, episode.action_mask, strict=True):
        if m and last and last[-1] is None:
            last = []
        last.append(t if m else None)
    return tokenizer.decode([t for t in last if t is not None], skip_special_tokens=True)


def action_mask(ranges: list[tuple], n: int, where: str) -> list[int]:
    """1 on the actions' tokens, from the first action on (``ranges``: increasing spans of ``n`` tokens, checked)."""
    if not ranges or any(not (0 <= a <= b <= n) for a, b in ranges) or any(
            ranges[i][1] > ranges[i + 1][0] for i in range(len(ranges) - 1)):
        raise AgentError(f"{where}: action_ranges {ranges!r:.80} are not increasing spans of observation_tokens "
                         f"({n} tokens)")
    start = ranges[0][0]
    mask = [0] * (n - start)
    for a, b in ranges:
        mask[a - start : b - start] = [1] * (b - a)
    return mask


def episode_of(result: Any, tok, with_logprobs: bool, where: str, vision: str | None = None,
               seen: list[int] | None = None) -> Episode:
    """An executor's episode dict (OpenRLHF's keys) as an :class:`Episode`, checked. ``vision``: a vision-language
    policy's folder: the trajectory's image tokens (one per image of ``result["images"]``) are expanded into their
    blocks, which must agree with ``seen`` (the last action's prompt as vLLM expanded it)."""
    if not isinstance(result, dict) or not {"observation_tokens", "action_ranges"} <= set(result):
        raise AgentError(f"{where}: execute returned {result!r:.80}; expected OpenRLHF's episode dict "
                         "(observation_tokens, action_ranges, rollout_log_probs, reward, scores, extra_logs)")
    ids, ranges = [int(t) for t in result["observation_tokens"]], [tuple(r) for r in result["action_ranges"]]
    action_mask(ranges, len(ids), where)
    lp = _logprobs(result, len(ids), with_logprobs, where)
    images = None
    if vision is not None:
        ids, ranges, lp, images = _expanded(ids, ranges, lp if with_logprobs else None, result.get("images"), vision, seen, where)
    start, mask = ranges[0][0] if ranges else 0, action_mask(ranges, len(ids), where)
    logps = [float(x) for x in lp[start:]] if with_logprobs else None
    reward = result.get("reward")
    reward = None if reward is None else number(reward, "reward", where)
    scores = result.get("scores")
    score = reward if scores is None else number(scores, "scores", where)
    logs = {str(k): number(v, f"extra_logs[{k!r}]", where, nan_ok=True) for k, v in (result.get("extra_logs") or {}).items()}
    return Episode(ids[:start], ids[start:], tok.decode(ids[start:]), logps, result.get("finish_reason"), mask,
                   reward=reward, score=0.0 if score is None else score, turns=len(ranges), info=logs, images=images)


def _logprobs(result: dict, n: int, with_logprobs: bool, where: str) -> list | None:
    """An episode dict's ``rollout_log_probs`` when the run keeps them: one per observation token."""
    lp = result.get("rollout_log_probs")
    if with_logprobs and (lp is None or len(lp) != n):
        raise AgentError(f"{where}: rollout_log_probs must give one number per observation token (the run keeps the "
                         "engine's log-probs: async or algo.is_correction); set sampling_params.logprobs")
    return lp


def _expanded(ids, ranges, logps, images, vision: str, seen: list[int] | None, where: str):
    """A vision-language episode's trajectory as the learners see it (:func:`stages.common.vision.expand_episode`)."""
    from datasets_prep.images import image_refs
    from datasets_prep.loading import DataError
    from stages.common.vision import expand_episode

    try:
        refs = image_refs({"images": images}, "images", where)
        ids, ranges, logps = expand_episode(ids, ranges, logps, refs, vision)
    except (DataError, ValueError) as e:
        raise AgentError(f"{where}: the episode's images: {e}") from None
    if seen is not None and ids[: len(seen)] != list(seen):
        raise AgentError(f"{where}: the trajectory with its images expanded differs from the prompt vLLM saw for the last "
                         "action; an executor must give vLLM one image token per image with multi_modal_data")
    return ids, ranges, logps, refs
