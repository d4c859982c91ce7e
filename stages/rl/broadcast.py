"""Weights over a process group (``sync.transport: broadcast``): learner rank 0 broadcasts the policy tensor by
tensor, every rollout engine worker receives each one and loads it (OpenRLHF's and verl's vLLM weight-sync group).

The group: learner rank 0 (group rank 0) and every engine's workers (engine ``i``'s tensor-parallel worker ``r``
is group rank ``1 + i * tp + r``), meeting at a TCP store served on rank 0's node address only
(:func:`stages.common.trainer.rendezvous_store`). Gloo on CPU, NCCL on GPU (``sync.backend``). torch's own
``ProcessGroupGloo``/``ProcessGroupNCCL`` on a store of their own, outside the learners' default group, so the
same code runs in a learner, in a vLLM worker and in ``bench/gpu_check.py`` without Ray or vLLM.

The learner side walks the model module by module (:func:`named_weights`): under ZeRO-3 each module's
parameters are gathered on their own (LoRA: a LoRA layer's base weight and adapters together, sent merged under
the base model's name), copied into a bucket (``sync.bucket_mb``; a broadcast per full bucket, not per tensor)
and released, so the full model is never materialised twice. The workers load the tensors as they arrive:
:func:`receive` is the iterator vLLM's ``reload_weights`` consumes (the path that works on the CPU build too), so
a worker holds one bucket at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from datetime import timedelta

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
PREFIX = "rlhf-weight-sync"


def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float, local_host: str | None = None):
    """Join the weight-sync group meeting at ``host:port`` (served by rank 0); ``local_host``: the address this
    rank's gloo sockets bind (its own node's; default ``host``). Blocks until every rank has joined."""
    import torch.distributed as dist

    from stages.common.trainer import rendezvous_store

    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(PREFIX, rendezvous_store(host, port, rank, world_size, timeout))
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host or host)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"sync.backend: {backend!r} is not gloo or nccl")


def broadcast(group, tensor: torch.Tensor) -> None:
    """``tensor`` from group rank 0 to every rank (in place on the others)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def buckets(meta: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[int]]:
    """``meta``'s tensors cut into consecutive buckets of at most ``bucket_bytes`` (a larger tensor alone): one
    broadcast each. Sender and receivers cut the same way from the same ``meta``."""
    out: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        n = _nbytes(shape, dtype)
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def _nbytes(shape: list[int], dtype: str) -> int:
    n = DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n


def send(group, weights: Iterator[tuple[str, torch.Tensor]], meta: list[tuple[str, list[int], str]], device: torch.device,
         bucket_bytes: int) -> int:
    """Rank 0: the tensors of ``weights`` (in ``meta``'s order and dtype) copied into one bucket after another on
    ``device`` (NCCL: the GPU; gloo: the CPU), each bucket broadcast when full; the number of broadcasts."""
    weights = iter(weights)
    sent = 0
    for bucket in buckets(meta, bucket_bytes):
        dtype = DTYPES[meta[bucket[0]][2]]
        flat = torch.empty(sum(_nbytes(meta[i][1], meta[i][2]) for i in bucket) // dtype.itemsize, dtype=dtype, device=device)
        offset = 0
        for i in bucket:
            name, tensor = next(weights)
            if name != meta[i][0] or list(tensor.shape) != meta[i][1]:
                raise RuntimeError(f"weight sync: sending {name} {list(tensor.shape)} where the receivers expect "
                                   f"{meta[i][0]} {meta[i][1]}")
            n = tensor.numel()
            flat[offset : offset + n].copy_(tensor.detach().reshape(-1))
            offset += n
        broadcast(group, flat)
        sent += 1
    return sent


def receive(group, meta: list[tuple[str, list[int], str]], device: torch.device, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks > 0: each ``(name, shape, dtype)`` of ``meta`` in order, as views of the bucket it arrived in (on
    ``device``); one bucket held at a time."""
    for bucket in buckets(meta, bucket_bytes):
        dtype = DTYPES[meta[bucket[0]][2]]
        flat = torch.empty(sum(_nbytes(meta[i][1], meta[i][2]) for i in bucket) // dtype.itemsize, dtype=dtype, device=device)
        broadcast(group, flat)
        offset = 0
        for i in bucket:
            name, shape, _ = meta[i]
            n = _nbytes(shape, meta[i][2]) // dtype.itemsize
            yield name, flat[offset : offset + n].view(shape)
            offset += n


def named_weights(model, is_peft: bool, zero3: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as vLLM loads them (the base model's names; LoRA: every adapter merged into its base
    weight), one module at a time; under ZeRO-3 each module's parameters are gathered only while its tensors are
    used (every rank must walk the model alike: the gathers are collective). Tied parameters come once."""
    base = model.get_base_model() if is_peft else model
    lora_layer = _lora_layer_class() if is_peft else None
    gather: Callable = _zero3_gather if zero3 else (lambda params: nullcontext())
    seen: set[int] = set()
    inside: str | None = None  # a LoRA layer whose submodules were sent with it
    for name, module in base.named_modules():
        if inside is not None and name.startswith(inside + "."):
            continue
        inside = None
        if lora_layer is not None and isinstance(module, lora_layer):
            inside = name
            seen.update(id(p) for p in module.parameters())
            yield from _merged(name, module, gather)
            continue
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        yield from _own(name, own, gather)


def _own(name: str, own: list, gather: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters (not its submodules'), gathered meanwhile."""
    if not own:
        return
    with gather([p for _, p in own]):
        for n, p in own:
            yield (f"{name}.{n}" if name else n), p


def _merged(name: str, module, gather: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA layer's base weight with every active adapter merged into it (and its bias), gathered meanwhile."""
    with gather(list(module.parameters())):
        layer = module.get_base_layer()
        weight = layer.weight
        for adapter in module.active_adapters:
            weight = weight + module.get_delta_weight(adapter)
        yield f"{name}.weight", weight
        if getattr(layer, "bias", None) is not None:
            yield f"{name}.bias", layer.bias


def weight_meta(model, is_peft: bool, zero3: bool, dtype: str) -> list[tuple[str, list[int], str]]:
    """What :func:`named_weights` sends, as the receivers allocate it: ``(name, shape, dtype)`` in order
    (collective under ZeRO-3, like a push)."""
    return [(name, list(t.shape), dtype) for name, t in named_weights(model, is_peft, zero3)]


def _zero3_gather(params):
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _lora_layer_class():
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def sync_device(backend: str) -> torch.device:
    """Where a rank's sent or received tensors live: its GPU for NCCL, the CPU for gloo."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

