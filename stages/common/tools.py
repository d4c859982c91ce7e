"""Tools for agent episodes (``rollout.tools``): plain typed Python functions the model may call mid-episode.

A tools file defines documented, typed functions (sync or ``async def``); each public function whose name does
not start with ``_`` and that is defined in the file is a tool (or the file lists them: ``TOOLS = [f, g]``). Their
JSON schemas come from the signature and the Google-style docstring (transformers' ``get_json_schema``, as TRL's
``tools=``), and the chat template renders them in the prompt (``apply_chat_template(..., tools=schemas)``).

A call in the model's action is parsed by ``rollout.tool_parser`` (:data:`PARSERS`; default ``hermes``, the
Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format); each result is appended as a
``tool`` message (rendered by the chat template, out of the loss) and the model acts again. A call that does not
parse, names no tool, has wrong arguments or raises gets its error text back as the tool's answer (as TRL does)
and counts as a failure; a tool that gives no answer within ``rollout.env_timeout_s`` fails the step (a hung
environment). At most ``rollout.max_tool_calls`` calls an episode: calls beyond them end the episode.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stages.common.plugins import PluginError, load_module


class ToolError(ValueError):
    """A tools file that does not load, or a tool without the schema a model needs; the message names both."""


@dataclass(frozen=True)
class Tools:
    ref: str
    functions: dict[str, Callable[..., Any]]
    schemas: list[dict]

    @property
    def names(self) -> list[str]:
        return list(self.functions)


def load_tools(ref: str) -> Tools:
    """The tools of a file or module (``TOOLS`` when it lists them, else its own public functions), with their
    JSON schemas; a function without a docstring describing every argument, or without type hints, is refused."""
    from transformers.utils import get_json_schema

    try:
        module = load_module(ref, "rollout.tools", ToolError)
    except PluginError as e:
        raise ToolError(str(e)) from e
    listed = getattr(module, "TOOLS", None)
    funcs = list(listed) if listed is not None else [
        f for name, f in vars(module).items()
        if inspect.isfunction(f) and not name.startswith("_") and f.__module__ == module.__name__]
    if not funcs or not all(callable(f) for f in funcs):
        raise ToolError(f"rollout.tools {ref}: defines no tools (typed, documented functions, or TOOLS = [f, ...])")
    schemas = []
    for f in funcs:
        try:
            schemas.append(get_json_schema(f))
        except Exception as e:
            raise ToolError(f"rollout.tools {ref}: {getattr(f, '__name__', f)}: {e} (a tool needs type hints and a "
                            "docstring with an Args: line per argument, as transformers' get_json_schema reads them)") from e
    return Tools(ref, {s["function"]["name"]: f for s, f in zip(schemas, funcs, strict=True)}, schemas)


@dataclass
class ToolCall:
    """A call parsed from an action: its tool's name and arguments, or why it could not be parsed (``error``)."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text`` (the arguments may also be a
    JSON string of the object, as some models write them)."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"the tool call is not JSON ({e.msg} at character {e.pos}): {body.strip()[:80]}"))
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            calls.append(ToolCall(None, error='a tool call needs {"name": "<tool>", "arguments": {...}}; got '
                                              f"{body.strip()[:80]}"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def register_parser(name: str, parser: Callable[[str], list[ToolCall]]) -> None:
    """A tool-call format of your own, by name (``rollout.tool_parser``): ``parser(action_text) -> [ToolCall]``."""
    PARSERS[name] = parser


def render(result: Any) -> str:
    """A tool's answer as the text of its ``tool`` message: a string as it is, anything else as JSON (or str)."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def tool_metrics(names: list[str]) -> list[str]:
    """The metrics an episode with these tools logs (``tool_calls``/``tool_failures`` per episode, and per tool)."""
    return ["tool_calls", "tool_failures", *(f"tool_calls_{n}" for n in names), *(f"tool_failures_{n}" for n in names)]


class ToolCalls:
    """One episode's tool calls: parsed from its actions, answered, counted (``logs``)."""

    def __init__(self, tools: Tools, parser: Callable[[str], list[ToolCall]] | None, max_calls: int):
        self.tools, self.parse, self.max_calls = tools, parser or parse_hermes, max_calls
        self.calls = {n: 0 for n in tools.names}
        self.failures = {n: 0 for n in tools.names}
        self.total = self.failed = 0

    def allowed(self, calls: list[ToolCall]) -> bool:
        """Whether the episode may make these calls too (``rollout.max_tool_calls`` an episode)."""
        return self.total + len(calls) <= self.max_calls

    async def answer(self, calls: list[ToolCall], settings, where: str) -> list[dict]:
        """Each call's answer as a ``tool`` message: the tool's result, or the error text of a call that failed."""
        from stages.common.agents import EnvironmentTimeout, call

        messages = []
        for c in calls:
            self.total += 1
            fn = self.tools.functions.get(c.name) if c.error is None else None
            if c.error is None and fn is None:
                c.error = f"unknown tool {c.name!r}; the tools are {', '.join(self.tools.names)}"
            if c.error is None:
                self.calls[c.name] += 1
                try:
                    content = render(await call(_bound(fn, c.arguments), timeout_s=settings.env_timeout_s,
                                                what=f"{where}: tool {c.name}"))
                except EnvironmentTimeout:
                    raise
                except Exception as e:  # the model sees what went wrong, as TRL does
                    c.error = f"{type(e).__name__}: {e}"
            if c.error is not None:
                self.failed += 1
                if c.name in self.failures:
                    self.failures[c.name] += 1
                content = f"Error: {c.error}"
            messages.append({"role": "tool", "name": c.name or "unknown", "content": content})
        return messages

    def logs(self) -> dict[str, float]:
        return {"tool_calls": float(self.total), "tool_failures": float(self.failed),
                **{f"tool_calls_{n}": float(v) for n, v in self.calls.items()},
                **{f"tool_failures_{n}": float(v) for n, v in self.failures.items()}}


def _bound(fn: Callable[..., Any], arguments: dict) -> Callable[[], Any]:
    """``fn`` with the call's arguments bound (a TypeError for arguments it does not take), sync or async as ``fn``."""
    inspect.signature(fn).bind(**arguments)
    if inspect.iscoroutinefunction(fn):
        async def bound():
            return await fn(**arguments)
    else:
        def bound():
            return fn(**arguments)
    return bound
