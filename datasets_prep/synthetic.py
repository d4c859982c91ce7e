"""The embedded default task: integer addition with a verifiable answer.

A prompt is ``"A+B"`` with operands of 1 or 2 digits; the answer is the decimal sum. It is easy to
verify, and hard enough that the 3.4M-parameter default model after a few minutes of SFT is far from
perfect (measured: about a quarter right after 500 steps), while single-digit sums are learned first,
so preference and RL stages have something graded to improve.

``write_task_files`` writes ordinary JSONL files in the formats user data comes in:

- ``sft.jsonl``: ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``
- ``preference.jsonl`` / ``preference_eval.jsonl``: ``{"prompt", "chosen", "rejected"}``
  (chosen is the right sum, rejected a plausible wrong one)
- ``rl_prompts.jsonl``: ``{"prompt", "answer"}``
- ``eval.jsonl``: ``{"prompt", "answer"}``, problems that appear in no training file.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SPLITS = {"sft": 8000, "preference": 2000, "preference_eval": 200, "rl_prompts": 2000, "eval": 200}
MAX_DIGITS = 2
_ANSWER = re.compile(r"-?\d+")


def make_problem(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(0, 10 ** rng.randint(1, MAX_DIGITS))
    b = rng.randrange(0, 10 ** rng.randint(1, MAX_DIGITS))
    return f"{a}+{b}", str(a + b)


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A wrong sum: a near miss (one digit off by one) a quarter of the time, else any other number in
    the range of possible sums. Most wrong answers then differ in the units digit, which a reward
    model can learn to check; the near misses keep some pairs hard."""
    n = int(answer)
    if rng.random() < 0.25:
        cand = n + rng.choice([-1, 1]) * 10 ** rng.randrange(len(answer))
        if cand >= 0:
            return str(cand)
    top = 2 * (10**MAX_DIGITS - 1)
    cand = rng.randrange(0, top)
    return str(cand if cand != n else top)


def extract_answer(response: str) -> str | None:
    """The first integer in a response, or None."""
    m = _ANSWER.search(response)
    return m.group(0) if m else None


def is_correct(response: str, answer: str) -> bool:
    return extract_answer(response) == str(answer).strip()


def generate(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Deterministic rows per split; eval problems are disjoint from every training split."""
    sizes = {**SPLITS, **(sizes or {})}
    rng = random.Random(seed)
    held_out: set[str] = set()
    eval_rows = []
    while len(eval_rows) < sizes["eval"]:
        p, a = make_problem(rng)
        if p not in held_out:
            held_out.add(p)
            eval_rows.append({"prompt": p, "answer": a})

    def fresh() -> tuple[str, str]:
        while True:
            p, a = make_problem(rng)
            if p not in held_out:
                return p, a

    out: dict[str, list[dict]] = {"eval": eval_rows}
    out["sft"] = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}
        for p, a in (fresh() for _ in range(sizes["sft"]))
    ]
    for split in ("preference", "preference_eval"):
        out[split] = [
            {"prompt": p, "chosen": a, "rejected": wrong_answer(a, rng)}
            for p, a in (fresh() for _ in range(sizes[split]))
        ]
    out["rl_prompts"] = [{"prompt": p, "answer": a} for p, a in (fresh() for _ in range(sizes["rl_prompts"]))]
    return out


def write_task_files(folder: str | Path, seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """Write one JSONL file per split into ``folder``; returns split -> path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in generate(seed, sizes).items():
        path = folder / f"{split}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
        paths[split] = path
    return paths


def corpus(seed: int = 0, n: int = 3000) -> list[str]:
    """Plain texts of the task, for training the tokenizer."""
    rng = random.Random(seed + 1)
    return [f"{p} = {a}" for p, a in (make_problem(rng) for _ in range(n))]
