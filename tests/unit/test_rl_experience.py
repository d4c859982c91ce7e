"""The RL step's typed pipeline: what a step needs is decided once; experience and updates by hand."""

from __future__ import annotations

import pytest
import torch

from stages.common.generation import Completion
from stages.rl.config import RLConfig
from stages.rl.experience import Forward, KLController, Samples, Scores, StepPlan, make_experience, updates_of


def config(**algo) -> RLConfig:
    return RLConfig.model_validate({
        "data": {"paths": ["x.jsonl"]}, "algo": algo,
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 3},
        "train": {"train_batch_size": 4, "micro_train_batch_size": 2},
    })


@pytest.mark.parametrize("algo, expected", [
    ({}, dict(old_logp=False, ref_logp=False, values=False, rollout_logp=False, kl_in_reward=False)),
    ({"ppo_epochs": 2}, dict(old_logp=True, ref_logp=False, values=False, rollout_logp=True, kl_in_reward=False)),
    ({"init_kl_coef": 0.1}, dict(old_logp=True, ref_logp=True, values=False, rollout_logp=True, kl_in_reward=True)),
    ({"init_kl_coef": 0.1, "kl_in_reward": False}, dict(old_logp=False, ref_logp=True, values=False, rollout_logp=False, kl_in_reward=False)),
    ({"advantage_estimator": "gae"}, dict(old_logp=False, ref_logp=False, values=True, rollout_logp=False, kl_in_reward=False)),
])
def test_what_a_step_needs_is_decided_once_from_the_config(algo, expected):
    assert StepPlan.of(config(**algo)) == StepPlan(**expected)


def samples() -> Samples:
    # prompt [5, 6]; responses of 2, 1, 3, 2 tokens; two prompts x two samples
    groups = [[Completion([5, 6], [1, 2], "a", [-0.5, -0.25]), Completion([5, 6], [3], "b", [-1.0])],
              [Completion([5, 6], [1, 2, 3], "c", [-0.1, -0.2, -0.3]), Completion([5, 6], [4, 4], "d", [-2.0, -2.0])]]
    return Samples.of([0, 1], groups, pad_id=0, with_logp=True)


def test_samples_are_right_padded_with_the_sampled_tokens_and_log_probs_at_response_positions():
    s = samples()
    assert s.input_ids.tolist() == [[5, 6, 1, 2, 0], [5, 6, 3, 0, 0], [5, 6, 1, 2, 3], [5, 6, 4, 4, 0]]
    assert s.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert s.rollout_logp[2].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])


def test_experience_with_kl_in_the_reward_and_updates_split_over_ranks():
    cfg = config(advantage_estimator="dr_grpo", init_kl_coef=0.5, kl_estimator="k1")
    plan = StepPlan.of(cfg)
    s = samples()
    old = torch.zeros(4, 5)
    ref = torch.full((4, 5), -0.2)  # k1 = 0 - (-0.2) = 0.2 on every response token
    exp = make_experience(plan, cfg, s, Scores.of({"rewards": torch.tensor([1.0, 0.0, 2.0, 4.0]), "scores": torch.zeros(4)}),
                          Forward(old, ref, None), kl_coef=0.5)
    assert exp.kl[s.response_mask.bool()].tolist() == pytest.approx([0.2] * 8) and exp.kl[~s.response_mask.bool()].abs().sum() == 0
    # dr_grpo: score - group mean on the last token (+0.5, -0.5, -1, +1), -0.5 * 0.2 per token, returns summed to go
    first = exp.returns[0, 2:4].tolist()
    assert first == pytest.approx([0.5 - 0.1 - 0.1, 0.5 - 0.1])
    shares = updates_of(exp, cfg, n_ranks=2)
    assert len(shares) == 2 and len(shares[0]) == 1 and shares[0][0].size == 2
    assert shares[0][0].normaliser == shares[1][0].normaliser == 8.0  # every response token of the optimizer step
    assert torch.equal(shares[1][0].input_ids, s.input_ids[2:])
    assert shares[0][0].old_values is None and torch.equal(shares[0][0].ref_logp, ref[:2])


def test_adaptive_kl_controller():
    fixed = KLController(0.1, None, 1000)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    adaptive = KLController(0.1, target=0.5, horizon=1000)
    adaptive.update(1.0, 100)  # error clipped at +0.2: 0.1 * (1 + 0.2 * 100 / 1000)
    assert adaptive.value == pytest.approx(0.1 * 1.02)
