"""Preference pairs for the reward-model and DPO stages: validation, tokenization, pair batches.

A row has a prompt (text or chat messages), a chosen and a rejected response, and optionally a
margin. Each pair becomes two sequences, ``prompt + chosen`` and ``prompt + rejected``, sharing the
prompt tokens; the responses end with the template's end-of-turn token.

Batches put all chosen sequences first, then all rejected ones, so one forward pass scores both.
Every batch carries ``segment_ids`` (which sequence each token belongs to, -1 for padding) and
``last_index`` (the flat position of each sequence's last token). Per-sequence sums (DPO log-probs)
and last-token reads (reward scores) then work the same for padded and packed batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def check_pair_row(config: DataConfig):
    def check(row: dict, where: str) -> None:
        require_text(row, config.prompt_key, where, "prompt_key", allow_messages=True)
        chosen = require_text(row, config.chosen_key, where, "chosen_key")
        rejected = require_text(row, config.rejected_key, where, "rejected_key")
        if chosen.strip() == rejected.strip():
            raise DataError(
                f"{where}: '{config.chosen_key}' equals '{config.rejected_key}' ({chosen!r:.60}); a pair needs two different responses"
            )
        if config.margin_key is not None:
            m = row.get(config.margin_key)
            if isinstance(m, bool) or not isinstance(m, int | float):
                raise DataError(f"{where}: field '{config.margin_key}' is {m!r}; expected a number (margin_key='{config.margin_key}')")

    return check


def tokenize_pair(row: dict, tokenizer, config: DataConfig) -> PairExample:
    prompt = row[config.prompt_key]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return PairExample(
        prompt_ids=ids(render_prompt(tokenizer, prompt, config)),
        chosen_ids=ids(render_response(tokenizer, prompt, row[config.chosen_key], config)),
        rejected_ids=ids(render_response(tokenizer, prompt, row[config.rejected_key], config)),
        margin=float(row[config.margin_key]) if config.margin_key else 0.0,
    )


def prepare_pairs(config: DataConfig, tokenizer) -> tuple[list[PairExample], PrepReport]:
    """Load, validate and tokenize preference rows; apply the length policy to the longer side."""
    rows = load_rows(config, check_pair_row(config))
    report = PrepReport(rows=len(rows))
    bound = char_bound(tokenizer, config.max_len)
    pairs = []
    for row in rows:
        # the prompt with the longer response is what must fit: a row beyond the character bound cannot
        if text_chars(row[config.prompt_key]) + max(len(row[config.chosen_key]), len(row[config.rejected_key])) > bound:
            if config.overflow == "drop" or text_chars(row[config.prompt_key]) > bound:
                report.dropped += 1
                continue
            report.clipped += 1
            row = {**row, config.chosen_key: row[config.chosen_key][:bound], config.rejected_key: row[config.rejected_key][:bound]}
        p = tokenize_pair(row, tokenizer, config)
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
