"""Batches: padding, packing several examples into one row, and the deterministic batch schedule.

Packed rows concatenate examples; ``position_ids`` restart at 0 for each example and no
``attention_mask`` is passed, which makes ``transformers`` build a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``): no token attends across examples. The first token
of every example is never a target, so a packed row's loss equals the sum of its examples' losses.

The schedule is a pure function of (seed, epoch, step), so a resumed run sees exactly the batches an
uninterrupted one would, and every rank can count the global batch's loss tokens without talking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from datasets_prep.sft import Example


@dataclass
class PackedRow:
    input_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int]


def pack(examples: Sequence[Example], max_len: int) -> list[PackedRow]:
    """Greedy in-order packing into rows of at most ``max_len`` tokens."""
    rows: list[PackedRow] = []
    cur = PackedRow([], [], [])
    for ex in examples:
        n = len(ex.input_ids)
        if n > max_len:
            raise ValueError(f"example of {n} tokens exceeds max_len {max_len}; apply the length policy first")
        if cur.input_ids and len(cur.input_ids) + n > max_len:
            rows.append(cur)
            cur = PackedRow([], [], [])
        cur.input_ids += ex.input_ids
        cur.loss_mask += [0] + ex.loss_mask[1:]
        cur.position_ids += list(range(n))
    if cur.input_ids:
        rows.append(cur)
    return rows


def collate(items: Sequence[Example | PackedRow], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item. Packed rows get position ids and no attention mask."""
    width = max(len(it.input_ids) for it in items)
    packed = isinstance(items[0], PackedRow)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    pos = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it.input_ids)
        ids[i, :n] = torch.tensor(it.input_ids)
        mask[i, :n] = torch.tensor(it.loss_mask)
        mask[i, 0] = 0
        attn[i, :n] = 1
        if packed:
            pos[i, :n] = torch.tensor(it.position_ids)
            pos[i, n:] = torch.arange(width - n)  # padding forms its own segment, never a target
        else:
            pos[i] = torch.arange(width)
    batch = {"input_ids": ids, "loss_mask": mask, "position_ids": pos}
    if not packed:
        batch["attention_mask"] = attn
    return batch


def loss_tokens(item: Example | PackedRow) -> int:
    return sum(item.loss_mask[1:])


@dataclass(frozen=True)
class BatchSchedule:
    """Which items each rank trains on at each optimizer step.

    One global batch is ``train_batch_size`` items, split into ``world_size`` contiguous rank shares,
    each split into ``accumulation`` micro-batches of ``micro_batch_size``.
    """

    num_items: int
    train_batch_size: int
    micro_batch_size: int
    world_size: int
    seed: int

    @property
    def accumulation(self) -> int:
        return self.train_batch_size // (self.micro_batch_size * self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.train_batch_size

    def global_batch(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(self.num_items, generator=g).tolist()
        return perm[k * self.train_batch_size : (k + 1) * self.train_batch_size]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        batch = self.global_batch(step)
        share = self.train_batch_size // self.world_size
        mine = batch[rank * share : (rank + 1) * share]
        return [mine[i : i + self.micro_batch_size] for i in range(0, share, self.micro_batch_size)]


def check_batch_sizes(train_batch_size: int, micro_batch_size: int, world_size: int, num_items: int, where: str) -> None:
    """Raise ValueError unless the global batch splits evenly and the data holds at least one batch."""
    if train_batch_size % (micro_batch_size * world_size) != 0:
        raise ValueError(
            f"{where}: train_batch_size={train_batch_size} is not divisible by micro_train_batch_size "
            f"({micro_batch_size}) x world_size ({world_size}) = {micro_batch_size * world_size}"
        )
    if num_items < train_batch_size:
        raise ValueError(
            f"{where}: the dataset has {num_items} training items, fewer than train_batch_size={train_batch_size}"
        )
