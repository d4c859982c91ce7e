"""The embedded default task: integer addition with a verifiable answer, with or without shown work.

A prompt is ``"A+B"`` with operands of 1 to 3 digits; the answer is the decimal sum. An answer comes
in one of two forms, and the last integer in it is the sum:

- bare: ``"125"``;
- worked (column addition, units first): ``"Work: 7+8=15, 5+6+1=12, so 125"``.

The SFT data answers ``WORKED_FRACTION`` (30%) of prompts with work shown. The tiny model after the
default SFT answers bare most of the time under greedy decoding and is right far less often that way
(measured: 15% bare vs 42% worked): the format a model picks decides much of its accuracy, so the
stages after SFT have a measurable thing to learn. DPO and the reward model learn it from preference
pairs, RL from an answer-checking reward alone.

``write_task_files`` writes ordinary JSONL files in the formats user data comes in:

- ``sft.jsonl``: ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``
- ``preference.jsonl`` / ``preference_eval.jsonl``: ``{"prompt", "chosen", "rejected"}``; chosen is
  the right worked answer, rejected a bare wrong sum or, ``SLIP_FRACTION`` (10%) of the time, a
  worked answer with one slip in it (a column added wrong, a carry forgotten, the sum miscopied)
- ``rl_prompts.jsonl``: ``{"prompt", "answer"}``
- ``eval.jsonl``: ``{"prompt", "answer"}``, problems that appear in no training file.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SPLITS = {"sft": 8000, "preference": 2000, "preference_eval": 200, "rl_prompts": 2000, "eval": 200}
MAX_DIGITS = 3
# share of SFT answers that show their work; the rest give the bare sum
WORKED_FRACTION = 0.3
WORKED_PREFIX = "Work: "
# preference pairs: chosen is always the right worked answer; rejected is a worked answer with a slip
# this share of the time, else a bare wrong sum
SLIP_FRACTION = 0.1
_ANSWER = re.compile(r"-?\d+")


def make_problem(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(0, 10 ** rng.randint(1, MAX_DIGITS))
    b = rng.randrange(0, 10 ** rng.randint(1, MAX_DIGITS))
    return f"{a}+{b}", str(a + b)


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A wrong bare sum: a near miss (one digit off by one) a quarter of the time, else any other
    number in the range of possible sums."""
    n = int(answer)
    if rng.random() < 0.25:
        cand = n + rng.choice([-1, 1]) * 10 ** rng.randrange(len(answer))
        if cand >= 0:
            return str(cand)
    top = 2 * (10**MAX_DIGITS - 1)
    cand = rng.randrange(0, top)
    return str(cand if cand != n else top)


def column_add(prompt: str, drop_carry_at: int | None = None, slip_at: int | None = None, slip: int = 0) -> tuple[list[str], str]:
    """Column addition of ``"A+B"``, units first: the steps (``"5+6+1=12"``) and the sum they give.

    ``drop_carry_at`` forgets the carry into that column; ``slip_at``/``slip`` adds ``slip`` to that
    column's result. Either mistake is carried through to the later columns and the sum, as a person
    making it would."""
    a, b = (x[::-1] for x in prompt.split("+"))
    steps, digits, carry = [], [], 0
    n = max(len(a), len(b))
    for i in range(n):
        x, y = int(a[i]) if i < len(a) else 0, int(b[i]) if i < len(b) else 0
        c = 0 if i == drop_carry_at else carry
        total = max(0, x + y + c + (slip if i == slip_at else 0))
        steps.append(f"{x}+{y}" + (f"+{c}" if c else "") + f"={total}")
        if i < n - 1:
            digits.append(str(total % 10))
            carry = total // 10
        else:
            digits.append(str(total))
    return steps, "".join(reversed(digits))


def render_worked(steps: list[str], answer: str) -> str:
    return WORKED_PREFIX + ", ".join(steps) + f", so {answer}"


def worked_answer(prompt: str) -> str:
    """``"Work: 7+8=15, 5+6+1=12, so 125"`` for ``"57+68"``."""
    return render_worked(*column_add(prompt))


def wrong_worked_answer(prompt: str, rng: random.Random) -> str:
    """A worked answer with one realistic slip carried through to the sum: a column added wrong by
    one, a carry forgotten, or a right column addition whose sum is copied with one digit wrong."""
    steps, answer = column_add(prompt)
    carries = [i for i, s in enumerate(steps) if s.count("+") == 2]
    kind = rng.choice(["column", "carry", "copy"])
    if kind == "carry" and carries:
        return render_worked(*column_add(prompt, drop_carry_at=rng.choice(carries)))
    if kind == "copy":
        digits = list(answer)
        i = rng.randrange(len(digits))
        digits[i] = str((int(digits[i]) + rng.choice([1, 9])) % 10)
        wrong = "".join(digits).lstrip("0") or "0"
        if wrong != answer:
            return render_worked(steps, wrong)
    i = rng.randrange(len(steps))
    slip = rng.choice([-1, 1])
    if column_add(prompt, slip_at=i, slip=slip)[1] == answer:  # 0+0 - 1 clips to 0
        slip = 1
    return render_worked(*column_add(prompt, slip_at=i, slip=slip))


def extract_answer(response: str) -> str | None:
    """The last integer in a response (the sum, in both answer formats), or None."""
    found = _ANSWER.findall(response)
    return found[-1] if found else None


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
    out["sft"] = []
    for _ in range(sizes["sft"]):
        p, a = fresh()
        response = worked_answer(p) if rng.random() < WORKED_FRACTION else a
        out["sft"].append({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": response}]})
    for split in ("preference", "preference_eval"):
        out[split] = []
        for _ in range(sizes[split]):
            p, a = fresh()
            rejected = wrong_worked_answer(p, rng) if rng.random() < SLIP_FRACTION else wrong_answer(a, rng)
            out[split].append({"prompt": p, "chosen": worked_answer(p), "rejected": rejected})
    out["rl_prompts"] = [{"prompt": p, "answer": a} for p, a in (fresh() for _ in range(sizes["rl_prompts"]))]
    return out


def write_task_files(folder: str | Path, seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """Write one JSONL file per split into ``folder``; returns split -> path."""
    return write_splits(folder, generate(seed, sizes))


def write_splits(folder: str | Path, splits: dict[str, list[dict]]) -> dict[str, Path]:
    """One JSONL file per split in ``folder`` (each written whole, then renamed into place); split -> path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        path = folder / f"{split}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
        paths[split] = path
    return paths


def corpus(seed: int = 0, n: int = 3000) -> list[str]:
    """Plain texts of the task, for training the tokenizer."""
    rng = random.Random(seed + 1)
    return [f"{p} = {a}\n{p} {worked_answer(p)}" for p, a in (make_problem(rng) for _ in range(n))]
