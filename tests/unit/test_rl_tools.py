"""Tools for agent episodes: schemas from signatures and docstrings, the Hermes call format, each failure of a call
returned to the model as text and counted, a hung tool failing at its deadline."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from stages.common.agents import EnvironmentTimeout, EpisodeSettings
from stages.common.tools import ToolCall, ToolCalls, ToolError, load_tools, parse_hermes

AGENTS = Path(__file__).resolve().parents[1] / "agents"


def test_a_tools_file_gives_json_schemas_from_its_signatures_and_docstrings(tmp_path):
    tools = load_tools(str(AGENTS / "faulty_tools.py"))
    assert tools.names == ["add", "boom"]
    add = tools.schemas[0]
    assert add == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first integer"},
                                                        "b": {"type": "integer", "description": "the second integer"}},
                       "required": ["a", "b"]}, "return": {"type": "integer"}}}
    assert load_tools("recipes/tools/calculator.py").names == ["calculator"]  # public functions when TOOLS is absent
    undocumented = tmp_path / "bad_tools.py"
    undocumented.write_text("def f(x: int) -> int:\n    return x\n")
    with pytest.raises(ToolError, match=r"bad_tools.py: f: .*docstring with an Args: line per argument"):
        load_tools(str(undocumented))
    with pytest.raises(ToolError, match="not found"):
        load_tools(str(tmp_path / "missing.py"))


def test_hermes_calls_are_parsed_and_malformed_ones_say_why():
    text = ('I will call. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><tool_call>{"arguments": {}}</tool_call>')
    calls = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert calls[2].name is None and calls[2].error.startswith("the tool call is not JSON")
    assert calls[3].error.startswith('a tool call needs {"name": "<tool>", "arguments": {...}}')
    assert parse_hermes("12+30 is 42") == []


def test_each_failing_call_answers_its_error_and_counts_and_a_hung_tool_fails_at_its_deadline(tmp_path):
    f = tmp_path / "slow_tools.py"
    f.write_text(
        "import asyncio\n"
        "async def wait(s: float) -> str:\n"
        "    \"\"\"Sleep.\n\n    Args:\n        s: seconds\n    \"\"\"\n"
        "    await asyncio.sleep(s)\n    return 'done'\n"
        "def div(a: int, b: int) -> float:\n"
        "    \"\"\"Divide.\n\n    Args:\n        a: numerator\n        b: denominator\n    \"\"\"\n"
        "    return a / b\n")
    tools = load_tools(str(f))
    settings = EpisodeSettings(env_timeout_s=0.5)
    counter = ToolCalls(tools, None, max_calls=5)
    calls = [ToolCall("div", {"a": 6, "b": 3}), ToolCall("div", {"a": 1, "b": 0}), ToolCall("div", {"c": 1}),
             ToolCall("nope", {}), ToolCall("wait", {"s": 0.01})]
    assert counter.allowed(calls) and not counter.allowed([*calls, calls[0]])
    answers = asyncio.run(counter.answer(calls, settings, "row 1: turn 1"))
    assert [m["content"] for m in answers] == [
        "2.0", "Error: ZeroDivisionError: division by zero", "Error: TypeError: missing a required argument: 'a'",
        "Error: unknown tool 'nope'; the tools are wait, div", "done"]
    assert all(m["role"] == "tool" for m in answers)
    assert counter.logs() == {"tool_calls": 5.0, "tool_failures": 3.0, "tool_calls_wait": 1.0, "tool_calls_div": 3.0,
                              "tool_failures_wait": 0.0, "tool_failures_div": 2.0}
    with pytest.raises(EnvironmentTimeout, match=r"row 1: turn 2: tool wait gave no answer within 0.5 s \(rollout.env_timeout_s\)"):
        asyncio.run(ToolCalls(tools, None, 5).answer([ToolCall("wait", {"s": 60})], settings, "row 1: turn 2"))
