"""Preference losses: pure functions in registries, one signature per family.

Reward-model losses take :class:`RewardPair` and return a per-pair loss [N]. DPO-family losses take
:class:`PolicyPair` and return a per-pair loss [N]. Callers look a loss up by name with
:func:`reward_loss` / :func:`dpo_loss`; a bad name lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RewardPair:
    chosen: torch.Tensor  # [N] scalar rewards of the chosen responses
    rejected: torch.Tensor  # [N]
    margin: torch.Tensor  # [N] per-pair margin from the data (0 when none)


@dataclass
class PolicyPair:
    """Summed response log-probs [N] of the policy and the reference, plus loss settings."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    beta: float
    label_smoothing: float = 0.0

    @property
    def logits(self) -> torch.Tensor:
        """h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))."""
        return (self.policy_chosen - self.ref_chosen) - (self.policy_rejected - self.ref_rejected)


def _sigmoid_rm(p: RewardPair) -> torch.Tensor:
    """Bradley-Terry pairwise loss -log sigmoid(r_w - r_l - m) (Ouyang et al. 2022; margin: Llama 2)."""
    return -F.logsigmoid(p.chosen - p.rejected - p.margin)


def _logexp_rm(p: RewardPair) -> torch.Tensor:
    """log(1 + exp(r_l - r_w)), OpenRLHF's LogExpLoss. Equal to `sigmoid` without margin; ignores margin."""
    return torch.log1p(torch.exp(p.rejected - p.chosen))


def _dpo(p: PolicyPair) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta h); with label_smoothing e, conservative DPO
    (Mitchell 2023): -(1-e) log sigmoid(beta h) - e log sigmoid(-beta h)."""
    z = p.beta * p.logits
    return -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)


def _ipo(p: PolicyPair) -> torch.Tensor:
    """IPO (Azar et al. 2023): (h - 1/(2 beta))^2 on summed log-probs, as OpenRLHF (TRL averages
    the log-probs over tokens first; pass averaged log-probs to get that)."""
    return (p.logits - 1 / (2 * p.beta)) ** 2


REWARD_LOSSES: dict[str, Callable[[RewardPair], torch.Tensor]] = {"sigmoid": _sigmoid_rm, "logexp": _logexp_rm}
DPO_LOSSES: dict[str, Callable[[PolicyPair], torch.Tensor]] = {"dpo": _dpo, "cdpo": _dpo, "ipo": _ipo}


def _lookup(registry: dict, name: str, family: str) -> Callable:
    if name not in registry:
        raise ValueError(f"{family} loss '{name}' is unknown; valid: {', '.join(sorted(registry))}")
    return registry[name]


def reward_loss(name: str) -> Callable[[RewardPair], torch.Tensor]:
    return _lookup(REWARD_LOSSES, name, "reward-model")


def dpo_loss(name: str) -> Callable[[PolicyPair], torch.Tensor]:
    return _lookup(DPO_LOSSES, name, "preference")
