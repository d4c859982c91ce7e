"""The built-in visual task: questions about a small generated picture whose answers only the picture holds.

A picture is 56x56 (the ``tiny-vl`` model's one tile: 4 image tokens, one per 28x28 quadrant) with 1 to 4 filled
shapes, a square or a circle in red, green, blue or yellow, at most one per quadrant. Two kinds of question:

- ``How many shapes?`` -> ``1`` .. ``4`` (the count drawn uniformly);
- ``What colour is the circle?`` (or the square) -> the colour of the picture's only shape of that kind (colour
  drawn uniformly; the other shapes are of the other kind).

The answer is drawn first and the picture made to fit, so a text-only model can't beat chance: each question's
answers are uniform (1/4 for either kind; ``tests/unit/test_visual_task.py`` checks the best text-only guess on
the held-out rows). The grader is ``visual`` (``stages.common.graders``): the response's first word equals the label.

``write_visual_task_files`` writes ``sft.jsonl`` (``{"prompt", "response", "images"}``), ``rl_prompts.jsonl`` and
``eval.jsonl`` (``{"prompt", "answer", "images"}``); images are PNG data URIs (``data.image_key: images``). Eval
pictures appear in no training file.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

SPLITS = {"sft": 3000, "rl_prompts": 2000, "eval": 200}
SIZE = 56
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("square", "circle")
COUNT_QUESTION = "How many shapes?"


def draw(scene: list[tuple[int, str, str]], rng: random.Random):
    """The picture of ``scene`` ((quadrant 0-3, shape, colour) each): a PIL image."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    half = SIZE // 2
    for quadrant, shape, colour in scene:
        side = rng.randint(14, 20)
        x0 = (quadrant % 2) * half + rng.randint(2, half - side - 2)
        y0 = (quadrant // 2) * half + rng.randint(2, half - side - 2)
        box = (x0, y0, x0 + side, y0 + side)
        (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=COLOURS[colour])
    return image


def make_problem(rng: random.Random) -> tuple[str, str, list[tuple[int, str, str]]]:
    """(question, answer, scene), the answer drawn first."""
    quadrants = rng.sample(range(4), 4)
    if rng.random() < 0.5:
        n = str(rng.randint(1, 4))
        return COUNT_QUESTION, n, _scene(COUNT_QUESTION, n, quadrants, rng)
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    question = f"What colour is the {shape}?"
    return question, colour, _scene(question, colour, quadrants, rng)


def _scene(question: str, answer: str, quadrants: list[int], rng: random.Random) -> list[tuple[int, str, str]]:
    if question == COUNT_QUESTION:
        return [(q, rng.choice(SHAPES), rng.choice(list(COLOURS))) for q in quadrants[: int(answer)]]
    shape = question.removeprefix("What colour is the ").removesuffix("?")
    other = SHAPES[1 - SHAPES.index(shape)]
    return [(quadrants[0], shape, answer)] + [(q, other, rng.choice(list(COLOURS))) for q in quadrants[1 : 1 + rng.randint(0, 2)]]


QUESTION = re.compile(r"How many shapes\?|What colour is the (?:square|circle)\?")


def scene_for(question: str, answer: str, rng: random.Random) -> list[tuple[int, str, str]]:
    """Another scene whose answer to ``question`` (one of the task's, as :data:`QUESTION` matches) is ``answer``."""
    if not QUESTION.fullmatch(question):
        raise ValueError(f"{question!r} is not a question of the visual task")
    return _scene(question, answer, rng.sample(range(4), 4), rng)


def generate(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Deterministic rows per split; every eval picture (its scene) is in no training split."""
    from datasets_prep.images import encode_png

    sizes = {**SPLITS, **(sizes or {})}
    rng = random.Random(seed)
    held_out: set = set()
    out: dict[str, list[dict]] = {}
    for split in ("eval", "sft", "rl_prompts"):
        rows = []
        while len(rows) < sizes[split]:
            question, answer, scene = make_problem(rng)
            key = (question, tuple(sorted(scene)))
            if split != "eval" and key in held_out:
                continue
            if split == "eval":
                held_out.add(key)
            image = encode_png(draw(scene, rng))
            label = "response" if split == "sft" else "answer"
            rows.append({"prompt": question, label: answer, "images": [image]})
        out[split] = rows
    return out


def write_visual_task_files(folder: str | Path, seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """One JSONL file per split in ``folder``; split -> path."""
    from datasets_prep.synthetic import write_splits

    return write_splits(folder, generate(seed, sizes))


def corpus(seed: int = 0) -> list[str]:
    """Texts of the task for the tokenizer."""
    return [COUNT_QUESTION, *(f"What colour is the {s}?" for s in SHAPES), *COLOURS, "1 2 3 4"] * 20
