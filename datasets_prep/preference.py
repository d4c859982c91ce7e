"""Preference pairs for the reward-model and DPO stages: validation, tokenization, pair batches.

A row has a prompt (text or chat messages), a chosen and a rejected response, and optionally a
margin; :func:`pair_of` reads the shapes people download (prompt/response columns, UltraFeedback-style
message lists, HH-style transcripts with no prompt column) into that one form. Each pair becomes two
sequences, ``prompt + chosen`` and ``prompt + rejected``, sharing the prompt tokens; the responses end
with the template's end-of-turn token.

Batches put all chosen sequences first, then all rejected ones, so one forward pass scores both.
Every batch carries ``segment_ids`` (which sequence each token belongs to, -1 for padding) and
``last_index`` (the flat position of each sequence's last token). Per-sequence sums (DPO log-probs)
and last-token reads (reward scores) then work the same for padded and packed batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from datasets_prep.loading import DataConfig, DataError, load_rows, require_text
from datasets_prep.sft import PrepReport, char_bound, render_prompt, render_response, text_chars


@dataclass
class PairExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0
    # summed response log-probs under the reference model, when precomputed (DPO)
    ref_chosen: float | None = None
    ref_rejected: float | None = None


@dataclass
class PackedPairs:
    """Several pairs in one row: [p0+c0, p0+r0, p1+c1, p1+r1, ...] with positions restarting."""

    pairs: list[PairExample]


def _number(row: dict, key: str, where: str, role: str) -> float:
    m = row.get(key)
    if isinstance(m, bool) or not isinstance(m, int | float) or m != m:
        raise DataError(f"{where}: field '{key}' is {m!r}; expected a number ({role})")
    return float(m)


def _shared_len(chosen: Sequence, rejected: Sequence) -> int:
    """Length of the common prefix of two message lists or two texts."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    return k


def _transcript_prompt(chosen: str, rejected: str, marker: str) -> int:
    """Where a transcript pair's prompt ends: after the last ``marker`` in the common prefix; without one, the
    common prefix less a trailing space (TRL's extract_prompt)."""
    k = _shared_len(chosen, rejected)
    at = chosen.rfind(marker, 0, k)
    if at >= 0:
        return at + len(marker)
    return k - 1 if k > 0 and chosen[k - 1] == " " else k


def pair_of(row: dict, config: DataConfig, where: str) -> dict:
    """A preference row in any supported shape as ``{"prompt", "chosen", "rejected", "margin"}``.

    Shapes: a prompt column with text responses; chat-message ``chosen``/``rejected`` (UltraFeedback-style:
    the prompt is the ``prompt_key`` column when the row has one, else the messages both share, and each side
    ends with one assistant message); transcripts with no prompt column (Anthropic HH-style, ``prompt_key:
    null``: the prompt is the common prefix up to its last ``prompt_marker``). The prompt is text or a message
    list; the responses are text. Raises DataError naming the row, the field and what was expected.
    """
    chosen = require_text(row, config.chosen_key, where, "chosen_key", allow_messages=True)
    rejected = require_text(row, config.rejected_key, where, "rejected_key", allow_messages=True)
    if type(chosen) is not type(rejected):
        raise DataError(f"{where}: '{config.chosen_key}' is a {type(chosen).__name__} but '{config.rejected_key}' is a "
                        f"{type(rejected).__name__}; expected two texts or two message lists")
    has_prompt = config.prompt_key is not None and row.get(config.prompt_key) is not None
    prompt = require_text(row, config.prompt_key, where, "prompt_key", allow_messages=True) if has_prompt else None
    if isinstance(chosen, list):
        prompt, chosen, rejected = _message_pair(prompt, chosen, rejected, config, where)
    elif prompt is None:
        prompt, chosen, rejected = _transcript_pair(chosen, rejected, config, where)
    if chosen.strip() == rejected.strip():
        raise DataError(
            f"{where}: '{config.chosen_key}' equals '{config.rejected_key}' ({chosen!r:.60}); a pair needs two different responses"
        )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": _margin(row, config, where)}


def _message_pair(prompt, chosen: list, rejected: list, config: DataConfig, where: str) -> tuple[Any, str, str]:
    """Chat-message sides: the prompt (the column's, or the messages both share) and each side's one assistant reply."""
    if prompt is not None:
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        sides = [side[len(head):] if side[: len(head)] == head else side for side in (chosen, rejected)]
    else:
        k = _shared_len(chosen, rejected)
        if k == 0:
            raise DataError(f"{where}: '{config.chosen_key}' and '{config.rejected_key}' share no leading messages to take "
                            f"the prompt from; give the prompt in a column (prompt_key)")
        prompt, sides = chosen[:k], [chosen[k:], rejected[k:]]
    for key, side in zip((config.chosen_key, config.rejected_key), sides, strict=True):
        if len(side) != 1 or side[0]["role"] != "assistant":
            raise DataError(f"{where}: field '{key}' has {[m['role'] for m in side]} after the prompt; expected one "
                            f"assistant message (the response)")
    return prompt, sides[0][0]["content"], sides[1][0]["content"]


def _transcript_pair(chosen: str, rejected: str, config: DataConfig, where: str) -> tuple[str, str, str]:
    """Transcripts with no prompt column: the prompt is their common prefix up to its last ``prompt_marker``."""
    if config.prompt_key is not None:
        raise DataError(f"{where}: key '{config.prompt_key}' missing (prompt_key='{config.prompt_key}'); for transcripts "
                        f"with no prompt column set prompt_key: null")
    k = _transcript_prompt(chosen, rejected, config.prompt_marker)
    if k == 0:
        raise DataError(f"{where}: '{config.chosen_key}' and '{config.rejected_key}' share no prefix to take the prompt "
                        f"from (prompt_key: null)")
    prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    for key, text in ((config.chosen_key, chosen), (config.rejected_key, rejected)):
        if not text.strip():
            raise DataError(f"{where}: field '{key}' has no response after the shared prompt {prompt[-40:]!r}")
    return prompt, chosen, rejected


def _margin(row: dict, config: DataConfig, where: str) -> float:
    """The pair's margin: its ``margin_key`` column, or the difference of its two ``score_keys``, else 0."""
    if config.margin_key is not None:
        return _number(row, config.margin_key, where, f"margin_key='{config.margin_key}'")
    if config.score_keys is not None:
        a, b = config.score_keys
        return _number(row, a, where, f"score_keys={list(config.score_keys)}") - _number(row, b, where, f"score_keys={list(config.score_keys)}")
    return 0.0


def check_pair_row(config: DataConfig):
    def check(row: dict, where: str) -> None:
        pair_of(row, config, where)

    return check


def tokenize_pair(row: dict, tokenizer, config: DataConfig) -> PairExample:
    """Token ids of a preference row (any shape :func:`pair_of` reads)."""
    return _tokenize(pair_of(row, config, "row"), tokenizer, config)


def _tokenize(pair: dict, tokenizer, config: DataConfig) -> PairExample:
    prompt = pair["prompt"]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return PairExample(
        prompt_ids=ids(render_prompt(tokenizer, prompt, config)),
        chosen_ids=ids(render_response(tokenizer, prompt, pair["chosen"], config)),
        rejected_ids=ids(render_response(tokenizer, prompt, pair["rejected"], config)),
        margin=pair["margin"],
    )


def prepare_pairs(config: DataConfig, tokenizer) -> tuple[list[PairExample], PrepReport]:
    """Load, validate and tokenize preference rows; apply the length policy to the longer side."""
    rows = load_rows(config, check_pair_row(config))
    report = PrepReport(rows=len(rows))
    bound = char_bound(tokenizer, config.max_len)
    pairs = []
    for raw in rows:
        row = pair_of(raw, config, "row")
        # the prompt with the longer response is what must fit: a row beyond the character bound cannot
        if text_chars(row["prompt"]) + max(len(row["chosen"]), len(row["rejected"])) > bound:
            if config.overflow == "drop" or text_chars(row["prompt"]) > bound:
                report.dropped += 1
                continue
            report.clipped += 1
            row = {**row, "chosen": row["chosen"][:bound], "rejected": row["rejected"][:bound]}
        p = _tokenize(row, tokenizer, config)
        longest = len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))
        if longest > config.max_len:
            room = config.max_len - len(p.prompt_ids)
            if config.overflow == "drop" or room < 1:
                report.dropped += 1
                continue
            report.truncated += 1
            p = PairExample(p.prompt_ids, p.chosen_ids[:room], p.rejected_ids[:room], p.margin)
            if p.chosen_ids == p.rejected_ids:  # truncation erased the difference
                report.dropped += 1
                report.truncated -= 1
                continue
        pairs.append(p)
    if not pairs:
        raise DataError(f"{', '.join(config.paths)}: no pair left after the length policy ({report.summary()})")
    report.kept = len(pairs)
    return pairs, report


def pack_pairs(pairs: Sequence[PairExample], max_len: int) -> list[PackedPairs]:
    """Greedy in-order packing of whole pairs (both sequences of a pair share a row)."""
    rows: list[PackedPairs] = []
    cur: list[PairExample] = []
    used = 0
    for p in pairs:
        n = 2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)
        if cur and used + n > max_len:
            rows.append(PackedPairs(cur))
            cur, used = [], 0
        cur.append(p)
        used += n
    if cur:
        rows.append(PackedPairs(cur))
    return rows


def pair_items_from_json(rows: list[dict], packed: bool) -> list[PairExample | PackedPairs]:
    """Rebuild items written as ``dataclasses.asdict`` (the stages hand them to their ranks as JSON)."""
    if packed:
        return [PackedPairs([PairExample(**p) for p in d["pairs"]]) for d in rows]
    return [PairExample(**d) for d in rows]


def pairs_of(items: Sequence[PairExample | PackedPairs]) -> list[PairExample]:
    return [p for it in items for p in (it.pairs if isinstance(it, PackedPairs) else [it])]


def num_pairs(item: PairExample | PackedPairs) -> int:
    return len(item.pairs) if isinstance(item, PackedPairs) else 1


def collate_pairs(items: Sequence[PairExample | PackedPairs], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch scoring every pair's chosen and rejected sequences.

    Returns input_ids/position_ids [R, T] (+ attention_mask when not packed), loss_mask [R, T]
    (response tokens), segment_ids [R, T] (sequence index, -1 on padding), last_index [2N] (flat
    index of each sequence's last token; chosen 0..N-1, then rejected), margin [N].
    """
    pairs = pairs_of(items)
    n = len(pairs)
    packed = isinstance(items[0], PackedPairs)
    # (row, tokens, response mask, sequence index) for every sequence
    seqs = []
    if packed:
        k = 0
        for r, it in enumerate(items):
            for p in it.pairs:
                seqs.append((r, p.prompt_ids + p.chosen_ids, [0] * len(p.prompt_ids) + [1] * len(p.chosen_ids), k))
                seqs.append((r, p.prompt_ids + p.rejected_ids, [0] * len(p.prompt_ids) + [1] * len(p.rejected_ids), n + k))
                k += 1
        num_rows = len(items)
    else:
        for k, p in enumerate(pairs):
            seqs.append((k, p.prompt_ids + p.chosen_ids, [0] * len(p.prompt_ids) + [1] * len(p.chosen_ids), k))
        for k, p in enumerate(pairs):
            seqs.append((n + k, p.prompt_ids + p.rejected_ids, [0] * len(p.prompt_ids) + [1] * len(p.rejected_ids), n + k))
        num_rows = 2 * n
    fill = [0] * num_rows
    for r, toks, _, _ in seqs:
        fill[r] += len(toks)
    width = max(fill)
    ids = torch.full((num_rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((num_rows, width), dtype=torch.long)
    mask = torch.zeros((num_rows, width), dtype=torch.long)
    seg = torch.full((num_rows, width), -1, dtype=torch.long)
    last = torch.zeros(2 * n, dtype=torch.long)
    offset = [0] * num_rows
    for r, toks, resp, s in seqs:
        a, b = offset[r], offset[r] + len(toks)
        ids[r, a:b] = torch.tensor(toks)
        pos[r, a:b] = torch.arange(len(toks))
        mask[r, a:b] = torch.tensor(resp)
        mask[r, a] = 0  # a sequence's first token is never predicted from the one before it
        seg[r, a:b] = s
        last[s] = r * width + b - 1
        offset[r] = b
    for r in range(num_rows):  # padding: its own position run, never a target
        pos[r, offset[r]:] = torch.arange(width - offset[r])
    batch = {
        "input_ids": ids,
        "position_ids": pos,
        "loss_mask": mask,
        "segment_ids": seg,
        "last_index": last,
        "margin": torch.tensor([p.margin for p in pairs], dtype=torch.float32),
    }
    if not packed:
        batch["attention_mask"] = (seg >= 0).long()
    if all(p.ref_chosen is not None for p in pairs):
        batch["ref_chosen"] = torch.tensor([p.ref_chosen for p in pairs], dtype=torch.float32)
        batch["ref_rejected"] = torch.tensor([p.ref_rejected for p in pairs], dtype=torch.float32)
    return batch


def sequence_sums(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of per-token ``values`` [R, T] over each sequence's response tokens -> [2N]."""
    num = batch["last_index"].numel()
    weights = values * batch["loss_mask"].to(values.dtype)
    seg = batch["segment_ids"].clamp(min=0).flatten()
    return torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, seg, weights.flatten())


def pair_inputs(config, model_path: str, stage: str) -> tuple[list, list, PrepReport]:
    """A preference stage's (RM, DPO: ``config.data``, ``config.eval_data``, ``config.train``) data in the caller's
    process, before any rank starts: the training pairs (packed with ``data.packing``), checked to fit the batch
    sizes; the held-out pairs; the data report."""
    from transformers import AutoTokenizer

    from datasets_prep.packing import check_batch_sizes

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs, report = prepare_pairs(config.data, tokenizer)
    eval_pairs = prepare_pairs(config.eval_data, tokenizer)[0] if config.eval_data else []
    items = pack_pairs(pairs, config.data.max_len) if config.data.packing else pairs
    train = config.train
    check_batch_sizes(train.train_batch_size, train.micro_train_batch_size, train.world_size, len(items), ", ".join(config.data.paths))
    print(f"[{stage}] data: {report.summary()}; {len(eval_pairs)} eval pairs")
    return items, eval_pairs, report
