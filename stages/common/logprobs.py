"""Pure log-probability helpers shared by the stages' losses."""

from __future__ import annotations

import math

import torch


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token.

    logits: [B, T, V] for positions 0..T-1; input_ids: [B, T].
    Returns [B, T] where entry t is log p(input_ids[t] | tokens < t) and entry 0 is 0 (no prediction).
    Computed in fp32 whatever the logits' dtype.
    """
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logps.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (mask may be long or bool)."""
    return (values * mask.to(values.dtype)).sum()


def logprob_difference(engine: torch.Tensor, learner: torch.Tensor, min_prob: float = 0.0) -> tuple[float, float, int]:
    """Mean and max |engine - learner| log-prob over the tokens the learner gives at least ``min_prob``, and
    how many counted. Low-precision (bf16) engines move unlikely tokens' log-probs by far more than a real
    update does, while a stale or half-loaded engine moves the likely ones too."""
    keep = learner >= math.log(min_prob) if min_prob > 0 else torch.ones_like(learner, dtype=torch.bool)
    if not keep.any():
        return 0.0, 0.0, 0
    diff = (engine - learner).abs()[keep]
    return diff.mean().item(), diff.max().item(), int(keep.sum())
