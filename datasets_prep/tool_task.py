"""The built-in tool task: multiplying two 3-digit numbers, which the tiny model can only do with a calculator.

A prompt is ``"A*B"`` (100 <= A, B <= 999); the answer is the product. The tool is ``calculator(expression)``
(``recipes/tools/calculator.py``), rendered in every prompt by the chat template. The SFT data answers
``TOOL_FRACTION`` (20%) of its prompts with a tool call, the tool's answer and the product copied from it::

    <|user|>123*456<|end|><|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><|end|>
    <|tool|>56088<|end|><|assistant|>56088<|end|>

and the rest with the bare product (which a 3.4M-parameter model cannot compute). After SFT the model mostly
answers bare, and is right almost never that way; with the tool it only has to copy digits. RL from a reward
that checks the last answer (``recipes/rewards/tool_arithmetic.py``) has a measurable thing to learn: to call.

``write_tool_task_files`` writes ``sft.jsonl`` (``{"messages": [...], "tools": [schema]}``, TRL's tools column),
``rl_prompts.jsonl`` and ``eval.jsonl`` (``{"prompt", "answer"}``; eval problems appear in no training file).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPLITS = {"sft": 8000, "rl_prompts": 2000, "eval": 200}
TOOL_FRACTION = 0.2
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<|tool|>"]  # added (not special) to the tiny tokenizer with tools


def make_problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"{a}*{b}", str(a * b)


def tool_call(expression: str) -> str:
    """A calculator call in the Hermes format (``rollout.tool_parser: hermes``)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def schemas() -> list[dict]:
    from stages.common.tools import load_tools

    return load_tools(str(Path(__file__).resolve().parents[1] / "recipes" / "tools" / "calculator.py")).schemas


def conversation(prompt: str, answer: str, with_tool: bool) -> list[dict]:
    user = {"role": "user", "content": prompt}
    if not with_tool:
        return [user, {"role": "assistant", "content": answer}]
    return [user, {"role": "assistant", "content": tool_call(prompt)}, {"role": "tool", "name": "calculator", "content": answer},
            {"role": "assistant", "content": answer}]


def generate(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Deterministic rows per split; eval problems are disjoint from the training splits."""
    sizes = {**SPLITS, **(sizes or {})}
    rng = random.Random(seed)
    held_out: dict[str, str] = {}
    while len(held_out) < sizes["eval"]:
        p, a = make_problem(rng)
        held_out.setdefault(p, a)

    def fresh() -> tuple[str, str]:
        while True:
            p, a = make_problem(rng)
            if p not in held_out:
                return p, a

    tools = schemas()
    out: dict[str, list[dict]] = {"eval": [{"prompt": p, "answer": a} for p, a in held_out.items()]}
    out["sft"] = [{"messages": conversation(p, a, rng.random() < TOOL_FRACTION), "tools": tools}
                  for p, a in (fresh() for _ in range(sizes["sft"]))]
    out["rl_prompts"] = [{"prompt": p, "answer": a} for p, a in (fresh() for _ in range(sizes["rl_prompts"]))]
    return out


def write_tool_task_files(folder: str | Path, seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """One JSONL file per split in ``folder``; split -> path."""
    from datasets_prep.synthetic import write_splits

    return write_splits(folder, generate(seed, sizes))


def corpus(seed: int = 0, n: int = 1000) -> list[str]:
    """Texts of the task for the tokenizer: calls and answers."""
    rng = random.Random(seed + 2)
    return [f"{tool_call(p)} {a} tools: calculator(expression)" for p, a in (make_problem(rng) for _ in range(n))]


def final_answer(query: str) -> str:
    """The model's last answer in an episode's decoded text (special tokens kept): after its last assistant turn."""
    return query.rsplit("<|assistant|>", 1)[-1].replace("<|end|>", "")
