"""Test tools: ``add`` works, ``boom`` raises. The micro model writes no tool calls of its own, so the ``scripted``
parser (a test hook) reads every action as the same three calls: ``add(2, 3)``, one that is not JSON, ``boom``."""

from stages.common.tools import parse_hermes, register_parser


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


async def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


TOOLS = [add, boom]
SCRIPT = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
          "<tool_call>{not json}</tool_call>"
          '<tool_call>{"name": "boom", "arguments": {"x": "y"}}</tool_call>')
register_parser("scripted", lambda text: parse_hermes(SCRIPT))
