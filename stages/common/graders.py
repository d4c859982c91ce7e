"""Graders: is a response right for a row's label? Used by the eval stage's accuracy and pass@k, and by RL's
held-out eval (``eval_grader``).

A grader is ``grader(response: str, label) -> bool | float`` (a float in [0, 1] counts as partial credit).
``grader`` in a recipe is a built-in name or a reference for :func:`stages.common.plugins.load_callable`
(``module:function``, ``file.py``, ``file.py:function``; a file's default function is ``grade``):

- ``arithmetic``: the embedded addition task (the response's last integer equals the label);
- ``visual``: the built-in visual task (the response's first word equals the label);
- ``math``: math answers with ``math-verify`` (as OpenRLHF): the answer is what follows the last ``####``
  (GSM8K) or the last ``\\boxed{}``, else the last number or expression math-verify finds; the label may be a
  GSM8K solution (its ``#### N``), a number or LaTeX. Equal values match (``1/2`` and ``0.5``).

``math_reward_func`` is the same check as an OpenRLHF ``reward_func``
(``reward.func: stages.common.graders:math_reward_func``). ``extract_boxed_answer`` and ``grade_answer`` take the
arguments of OpenRLHF's ``openrlhf.utils`` functions of those names, so a reward file written against them runs here
with its import line changed to ``from stages.common.graders import extract_boxed_answer, grade_answer``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from stages.common.plugins import load_callable

# built-ins live in this module, so the code version of a stage that imports it covers them
BUILTIN = {"arithmetic": "stages.common.graders:arithmetic_correct", "math": "stages.common.graders:math_correct",
           "visual": "stages.common.graders:first_word_correct"}
_HASHES = re.compile(r"####\s*(.+)")


def resolve(ref: str) -> str:
    return BUILTIN.get(ref, ref)


def load_grader(ref: str) -> Callable[[str, Any], bool | float]:
    return load_callable(resolve(ref), "grade", "grader", "(response, label)")


def grade(grader: Callable[[str, Any], Any], response: str, label: Any, where: str) -> float:
    """The grader's verdict as a number in [0, 1]; an error names the grader's input."""
    try:
        value = grader(response, label)
    except Exception as e:
        raise RuntimeError(f"grader raised {type(e).__name__}: {e} on {where} (response {response[:60]!r}, label {label!r:.40})") from e
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise RuntimeError(f"grader returned {value!r} on {where}; expected a bool or a number in [0, 1]")
    return float(value)


def _answer_text(text: str) -> str:
    """The part of a response or label that holds the answer: after the last ``####``, else all of it."""
    found = _HASHES.findall(text)
    return found[-1].strip().replace(",", "") if found else text


def first_word_correct(response: str, label: Any) -> bool:
    """The visual task (``datasets_prep.visual_task``): the response's first word, case and punctuation aside, is the label."""
    words = re.findall(r"[A-Za-z0-9]+", response)
    return bool(words) and words[0].lower() == str(label).strip().lower()


def arithmetic_correct(response: str, label: Any) -> bool:
    from datasets_prep.synthetic import is_correct

    return is_correct(response, label)


def math_correct(response: str, label: Any) -> bool:
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = _answer_text(str(label))
    gold = parse(gold_text, parsing_timeout=timeout) or parse(f"${gold_text}$", parsing_timeout=timeout)
    answer = parse(_answer_text(response), parsing_timeout=timeout)
    if not gold or not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=timeout))


def math_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, list[float]]:
    rewards = [float(math_correct(q[len(p):] if q.startswith(p) else q, lab)) for q, p, lab in zip(queries, prompts, labels)]
    return {"rewards": rewards, "scores": rewards}


def extract_boxed_answer(text: str) -> str | None:
    """What the last ``\\boxed{...}`` of ``text`` holds (braces inside it balanced), or None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def grade_answer(given_answer: str | None, ground_truth: Any) -> bool:
    """Whether an answer already extracted (e.g. by :func:`extract_boxed_answer`) equals ``ground_truth``
    (:func:`math_correct`: equal values match); None matches nothing."""
    if given_answer is None or ground_truth is None:
        return False
    given = str(given_answer)
    return math_correct(given, ground_truth) or math_correct(f"${given}$", ground_truth)  # as text, else as LaTeX
