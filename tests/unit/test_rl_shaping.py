"""Reward shaping (overlong, stop-properly), the IS corrections of the engine/learner gap and DAPO's group
filter, against arithmetic written out here."""

from __future__ import annotations

import math

import pytest
import torch

from stages.common.generation import Completion
from stages.rl.algorithms import IS_CORRECTIONS, ISInput, groups_in_range, stop_properly_penalty
from stages.rl.config import RLConfig
from stages.rl.experience import Forward, Samples, Scores, StepPlan, make_experience

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
# old - rollout log-ratios: exp gives the ratios 0.4, 1.0, 2.0 | 6.0, 1.5 (and a masked 100)
LOG_RATIO = torch.log(torch.tensor([[0.4, 1.0, 2.0], [6.0, 1.5, 100.0]], dtype=torch.float64))
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]], dtype=torch.float64)
ROLLOUT = OLD - LOG_RATIO


def test_tis_clamps_each_token_ratio():
    w = IS_CORRECTIONS["tis"](ISInput(OLD, ROLLOUT, MASK, 0.5, 5.0))
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 2.0], [5.0, 1.5, 0.0]], dtype=w.dtype))


def test_icepop_drops_tokens_whose_ratio_is_outside():
    w = IS_CORRECTIONS["icepop"](ISInput(OLD, ROLLOUT, MASK, 0.5, 5.0))
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.5, 0.0]], dtype=w.dtype))


def test_seq_mask_tis_drops_whole_sequences_by_their_geometric_mean_ratio():
    # geometric means: (0.4 * 1 * 2) ** (1/3) = 0.928 (kept), (6 * 1.5) ** (1/2) = 3 (kept with [0.5, 5]; dropped with [0.5, 2])
    w = IS_CORRECTIONS["seq-mask-tis"](ISInput(OLD, ROLLOUT, MASK, 0.5, 5.0))
    assert torch.allclose(w, torch.tensor([[0.4, 1.0, 2.0], [6.0, 1.5, 0.0]], dtype=w.dtype))
    w = IS_CORRECTIONS["seq-mask-tis"](ISInput(OLD, ROLLOUT, MASK, 0.5, 2.0))
    assert torch.allclose(w, torch.tensor([[0.4, 1.0, 2.0], [0.0, 0.0, 0.0]], dtype=w.dtype))


@pytest.mark.parametrize("kind", sorted(IS_CORRECTIONS))
def test_is_weights_carry_no_gradient(kind):
    old = OLD.clone().requires_grad_(True)
    assert not IS_CORRECTIONS[kind](ISInput(old, ROLLOUT, MASK, 0.5, 5.0)).requires_grad


def test_stop_properly_penalty_scales_or_replaces_truncated_rewards():
    r, cut = torch.tensor([1.0, 0.5, -0.2]), torch.tensor([True, False, True])
    assert stop_properly_penalty(r, cut, 0.25).tolist() == pytest.approx([0.25, 0.5, -0.05])
    assert stop_properly_penalty(r, cut, -0.5).tolist() == pytest.approx([-0.5, 0.5, -0.5])
    assert stop_properly_penalty(r, cut, 1.0).tolist() == pytest.approx(r.tolist())


def test_dynamic_filter_keeps_groups_strictly_inside_the_range():
    scores = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0], dtype=torch.float32)  # group means 0, 2/3, 1, 1/3
    assert groups_in_range(scores, 3, 0.0, 1.0) == [1, 3]
    assert groups_in_range(scores, 3, 0.5, 1.0) == [1]
    assert groups_in_range(scores, 3, -0.1, 1.1) == [0, 1, 2, 3]


def config(**algo) -> RLConfig:
    return RLConfig.model_validate({
        "data": {"paths": ["x.jsonl"]}, "algo": {"advantage_estimator": "dr_grpo", **algo},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 4},
        "train": {"train_batch_size": 4, "micro_train_batch_size": 2},
    })


def test_both_length_penalties_shape_the_reward_before_the_advantages():
    # responses of 4 (hit max_new_tokens, no stop token), 2, 3 (stopped by a stop token), 4 tokens
    finish = [("length", 4), ("stop", 2), ("stop", 3), ("length", 4)]
    groups = [[Completion([7], [1] * n, "", None, reason) for reason, n in finish[:2]],
              [Completion([7], [1] * n, "", None, reason) for reason, n in finish[2:]]]
    s = Samples.of([0, 1], groups, pad_id=0, with_logp=False)
    assert s.truncated.tolist() == [True, False, False, True]
    cfg = config(overlong_buffer=2, overlong_penalty=1.0, stop_properly_penalty=0.5)
    rewards = torch.tensor([1.0, 1.0, 2.0, 0.0])
    exp = make_experience(StepPlan.of(cfg), cfg, s, Scores.of({"rewards": rewards, "scores": rewards}), Forward(None, None, None), 0.0)
    # overlong: expected length 4 - 2 = 2; lengths 4, 2, 3, 4 -> -1, 0, -0.5, -1; then truncated rows x 0.5
    shaped = [(1.0 - 1.0) * 0.5, 1.0, 2.0 - 0.5, (0.0 - 1.0) * 0.5]
    assert exp.shaped.tolist() == pytest.approx(shaped)
    # dr_grpo: shaped - group mean, on the last response token
    last = [exp.advantages[i, s.response_mask[i].nonzero().max()].item() for i in range(4)]
    assert last == pytest.approx([shaped[0] - (shaped[0] + shaped[1]) / 2, shaped[1] - (shaped[0] + shaped[1]) / 2,
                                  shaped[2] - (shaped[2] + shaped[3]) / 2, shaped[3] - (shaped[2] + shaped[3]) / 2])


def test_is_correction_makes_the_engine_report_its_log_probs_and_settings_are_checked():
    assert StepPlan.of(config(is_correction="icepop")).rollout_logp and not StepPlan.of(config()).rollout_logp
    with pytest.raises(ValueError, match=r"is_threshold: \[2.0, 1.0\] must satisfy 0 <= low < high"):
        config(is_correction="tis", is_threshold=(2.0, 1.0))
    with pytest.raises(ValueError, match="stop_properly_penalty: 1.5 must be in"):
        config(stop_properly_penalty=1.5)
    with pytest.raises(ValueError, match=r"dynamic_filtering: \(1.0, 0.0\) must be"):
        config(dynamic_filtering=(1.0, 0.0))
    with pytest.raises(ValueError, match="is_correction"):
        config(is_correction="clip")
    assert math.isfinite(config(dynamic_filtering=(0.0, 1.0)).algo.dynamic_filtering_max_batches)
