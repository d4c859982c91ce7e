"""RL estimators, KL estimators and policy losses against arithmetic written out here."""

import math

import pytest
import torch

from stages.rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInput,
    PolicyLossInput,
    aggregate,
    aggregation_normaliser,
    cumulative_returns,
    gae_advantages,
    lookup,
    policy_objective,
    token_rewards,
    value_loss,
)

# 2 prompts x 2 samples; response lengths 3, 2, 1, 3
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
SCORES = torch.tensor([1.0, 0.0, 2.0, 4.0], dtype=torch.float64)


def adv(name, **kw):
    return ADVANTAGE_ESTIMATORS[name](AdvantageInput(SCORES, MASK, group_size=2, **kw))[0]


def spread(per_seq):
    """A sequence-level value on every response token (returns with gamma 1 and no KL)."""
    return torch.tensor(per_seq, dtype=torch.float64).unsqueeze(1) * MASK


def test_rloo_baseline_is_the_mean_of_the_others():
    # group 1: 1 - 0 = 1, 0 - 1 = -1; group 2: 2 - 4 = -2, 4 - 2 = 2
    assert torch.allclose(adv("rloo"), spread([1, -1, -2, 2]))


def test_group_norm_divides_by_the_unbiased_group_std():
    # group [1, 0]: mean 0.5, std sqrt(0.5) -> +-0.5 / 0.70710678 = +-0.70710678; group [2, 4] likewise
    s = 1 / math.sqrt(2)
    assert torch.allclose(adv("group_norm"), spread([s, -s, -s, s]), atol=1e-6)
    same = ADVANTAGE_ESTIMATORS["group_norm"](AdvantageInput(torch.ones(4, dtype=torch.float64), MASK, 2))[0]
    assert torch.equal(same, torch.zeros_like(same))  # no signal in a group that all scored alike


def test_dr_grpo_subtracts_the_group_mean_only():
    assert torch.allclose(adv("dr_grpo"), spread([0.5, -0.5, -1.0, 1.0]))


def test_reinforce_baseline_whitens_globally_over_response_tokens():
    # baselined returns on the 9 response tokens: 0.5 x3, -0.5 x2, -1 x1, 1 x3
    vals = [0.5] * 3 + [-0.5] * 2 + [-1.0] + [1.0] * 3
    mean = sum(vals) / 9  # 2.5 / 9
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 9)
    expected = spread([(0.5 - mean) / std, (-0.5 - mean) / std, (-1 - mean) / std, (1 - mean) / std])
    assert torch.allclose(adv("reinforce_baseline"), expected, atol=1e-6)


def test_reinforce_puts_the_score_on_the_last_token_minus_per_token_kl():
    kl = torch.full((4, 3), 0.1, dtype=torch.float64)
    rewards = token_rewards(SCORES, kl, 0.5, MASK)
    # -0.05 on every response token, + score on the last one
    assert torch.allclose(rewards[0], torch.tensor([-0.05, -0.05, 0.95], dtype=torch.float64))
    assert torch.allclose(rewards[1], torch.tensor([-0.05, -0.05, 0.0], dtype=torch.float64))
    assert torch.allclose(rewards[2], torch.tensor([1.95, 0.0, 0.0], dtype=torch.float64))
    returns = cumulative_returns(rewards, MASK)
    assert torch.allclose(returns[0], torch.tensor([0.85, 0.9, 0.95], dtype=torch.float64))
    assert torch.allclose(returns[1], torch.tensor([-0.1, -0.05, 0.0], dtype=torch.float64))
    # discounting: gamma 0.5 on sequence 0: [-0.05 + 0.5 * (-0.05 + 0.5 * 0.95), ...]
    disc = cumulative_returns(rewards, MASK, gamma=0.5)
    assert disc[0, 0].item() == pytest.approx(-0.05 + 0.5 * (-0.05 + 0.5 * 0.95))
    a, ret = ADVANTAGE_ESTIMATORS["reinforce"](AdvantageInput(SCORES, MASK, 2, kl=kl, kl_coef=0.5))
    assert torch.allclose(ret, returns)
    m = MASK.bool()
    assert abs(a[m].mean().item()) < 1e-9 and a[m].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def test_reward_clipping_applies_after_the_baseline():
    # rloo baselined scores 1, -1, -2, 2 clipped to [-1.5, 1.5]
    assert torch.allclose(adv("rloo", reward_clip=1.5), spread([1, -1, -1.5, 1.5]))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log2 = math.log(2)
    assert KL_ESTIMATORS["k1"](logp, ref).item() == pytest.approx(log2)
    assert KL_ESTIMATORS["k2"](logp, ref).item() == pytest.approx(0.5 * log2**2)
    assert KL_ESTIMATORS["k3"](logp, ref).item() == pytest.approx(0.5 - 1 + log2)  # e^{-ln2} - 1 + ln2
    same = torch.tensor([-1.3])
    assert all(KL_ESTIMATORS[k](same, same).item() == 0 for k in ("k1", "k2", "k3"))


def _ppo(ratios, advantages, **kw):
    logp = torch.log(torch.tensor([ratios], dtype=torch.float64))
    a = torch.tensor([advantages], dtype=torch.float64)
    inp = PolicyLossInput(logp, torch.zeros_like(logp), a, torch.ones_like(a), **kw)
    loss, clipped = POLICY_LOSSES["ppo"](inp)
    return loss[0].tolist(), clipped[0].tolist()


def test_ppo_clip_low_high_and_dual_clip():
    # ratio 1.5, A=+1: min(1.5, 1.2) -> -1.2 (clipped); ratio 0.5, A=+1: min(0.5, 0.8) -> -0.5;
    # ratio 0.5, A=-1: min(-0.5, -0.8) -> 0.8 (clipped); ratio 3, A=-1: min(-3, -1.2) -> 3
    loss, clipped = _ppo([1.5, 0.5, 0.5, 3.0], [1.0, 1.0, -1.0, -1.0])
    assert loss == pytest.approx([-1.2, -0.5, 0.8, 3.0]) and clipped == [True, False, True, False]
    # clip-higher: eps_high 0.28 lets the positive ratio reach 1.28
    loss, _ = _ppo([1.5], [1.0], clip_eps_high=0.28)
    assert loss == pytest.approx([-1.28])
    # dual clip c=2 bounds the negative-advantage loss at 2 * |A|
    loss, clipped = _ppo([3.0, 0.5], [-1.0, -1.0], dual_clip=2.0)
    assert loss == pytest.approx([2.0, 0.8]) and clipped == [True, True]


def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    # sequence 0: token log-ratios [ln 2, 0] -> ratio exp(ln2 / 2) = 1.41421 > 1.2, A = 1 -> -1.2 per token
    # sequence 1: ratios 1, A = -1 -> 1 per token
    logp = torch.tensor([[math.log(2), 0.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    inp = PolicyLossInput(logp, torch.zeros(2, 2, dtype=torch.float64), torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64),
                          torch.ones(2, 2, dtype=torch.float64))
    loss, clipped = POLICY_LOSSES["gspo"](inp)
    assert loss.flatten().tolist() == pytest.approx([-1.2, -1.2, 1.0, 1.0])
    assert clipped[0].all() and not clipped[1].any()
    aggregate(loss, inp.mask, "seq_mean_token_mean", 2.0).backward()
    # unclipped sequence 1: d/dlogp of -(ratio * A) averaged over its 2 tokens, halved by 2 sequences: 0.25 each
    assert logp.grad[1].tolist() == pytest.approx([0.25, 0.25])
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0])


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_does_not_depend_on_the_micro_batch_split(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 5, generator=g) > 0.3).double()
    mask[:, 0] = 1
    whole = aggregate(loss, mask, mode, aggregation_normaliser([mask], mode, 5))
    parts = [(loss[i : i + 3], mask[i : i + 3]) for i in range(0, 8, 3)]  # uneven: 3, 3, 2
    norm = aggregation_normaliser([m for _, m in parts], mode, 5)
    assert sum(aggregate(lo, m, mode, norm) for lo, m in parts).item() == pytest.approx(whole.item(), abs=1e-12)
    if mode == "token_mean":
        assert whole.item() == pytest.approx(((loss * mask).sum() / mask.sum()).item())


def test_bad_keys_list_the_valid_ones():
    with pytest.raises(ValueError, match="advantage_estimator: .vtrace. is unknown; valid: dr_grpo, gae, group_norm, reinforce"):
        lookup(ADVANTAGE_ESTIMATORS, "vtrace", "advantage_estimator")
    with pytest.raises(ValueError, match="group"):
        ADVANTAGE_ESTIMATORS["rloo"](AdvantageInput(torch.ones(3), torch.ones(3, 2), 2))


def test_gae_by_hand_on_variable_length_masked_responses():
    # two responses: lengths 3 and 2 (the third position of the second is padding, holding junk)
    values = torch.tensor([[0.5, 0.2, 0.1], [1.0, 0.4, 99.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    g, lam = 0.9, 0.8
    adv, ret = gae_advantages(values, rewards, mask, g, lam)
    # row 0: d2 = 1 - 0.1 = 0.9; d1 = 0 + 0.9*0.1 - 0.2 = -0.11; d0 = 0 + 0.9*0.2 - 0.5 = -0.32
    a2 = 0.9
    a1 = -0.11 + g * lam * a2
    a0 = -0.32 + g * lam * a1
    # row 1: the value past the end counts as 0: d1 = 2 - 0.4 = 1.6; d0 = 0 + 0.9*0.4 - 1 = -0.64
    b1 = 1.6
    b0 = -0.64 + g * lam * b1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2], [b0, b1, 0.0]], dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor([[a0 + 0.5, a1 + 0.2, a2 + 0.1], [b0 + 1.0, b1 + 0.4, 0.0]], dtype=torch.float64))
    # lambda 1, gamma 1: the advantage is the return-to-go minus the value
    adv1, ret1 = gae_advantages(values, rewards, mask, 1.0, 1.0)
    assert torch.allclose(ret1, cumulative_returns(rewards * mask, mask))
    assert torch.allclose(adv1, ret1 - values * mask)


def test_clipped_value_loss_by_hand():
    v, old, ret = (torch.tensor([[x]], dtype=torch.float64) for x in (1.0, 0.5, 0.0))
    one = torch.ones(1, 1)
    # unclipped: (1 - 0)^2 / 2 = 0.5; clip 0.2: V_clip = 0.5 + 0.2 = 0.7, max(0.49, 1.0) / 2 = 0.5
    assert value_loss(v, old, ret, one, None).item() == pytest.approx(0.5)
    assert value_loss(v, old, ret, one, 0.2).item() == pytest.approx(0.5)
    # the clipped value is farther from the return: V = 0.1 from V_old = 1.0, R = 0.6 -> V_clip = 0.8
    v, old, ret = (torch.tensor([[x]], dtype=torch.float64) for x in (0.1, 1.0, 0.6))
    assert value_loss(v, old, ret, one, 0.2).item() == pytest.approx(max(0.2**2, 0.5**2) / 2)
    assert value_loss(v, old, ret, one, None).item() == pytest.approx(0.5**2 / 2)
    assert value_loss(v, old, ret, torch.zeros(1, 1), 0.2).item() == 0.0


def test_every_kl_estimator_is_clamped_to_ten():
    logp, ref = torch.tensor([0.0, -50.0]), torch.tensor([-50.0, 0.0])
    for name in ("k1", "k2", "k3"):
        kl = KL_ESTIMATORS[name](logp, ref)
        assert torch.isfinite(kl).all() and kl.abs().max().item() == 10.0, name
    assert KL_ESTIMATORS["k1"](logp, ref).tolist() == [10.0, -10.0]


def test_ppo_log_ratio_is_clamped_to_twenty_before_exp():
    logp = torch.tensor([[100.0]], dtype=torch.float64, requires_grad=True)
    inp = PolicyLossInput(logp, torch.zeros(1, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))
    loss, _ = POLICY_LOSSES["ppo"](inp)
    assert loss.item() == pytest.approx(math.exp(20.0))  # -min(-e^20, -1.2) with the ratio e^20, not e^100 (inf in fp32)


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_a_masked_position_puts_no_nan_or_inf_into_the_loss_or_the_gradient(name):
    logp = torch.tensor([[-1.0, 1e4, float("nan")], [-0.5, -0.7, float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.1, -1e4, 0.0], [-0.4, float("-inf"), float("nan")]])
    advantages = torch.tensor([[1.0, 5.0, float("nan")], [-1.0, 2.0, float("inf")]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    old[1, 1] = -0.6  # an in-mask position stays finite; the junk is at masked ones only
    loss, clipped = POLICY_LOSSES[name](PolicyLossInput(logp, old, advantages, mask))
    total = aggregate(loss, mask, "token_mean", mask.sum().item())
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).any()
    assert not clipped[mask == 0].any()
    v = torch.tensor([[0.3, float("nan"), float("inf")]], requires_grad=True)
    vl = value_loss(v, torch.zeros(1, 3), torch.tensor([[1.0, float("nan"), 0.0]]), torch.tensor([[1.0, 0.0, 0.0]]), 0.2)
    vl.sum().backward()
    assert torch.isfinite(vl).all() and torch.isfinite(v.grad).all() and v.grad[0, 1:].tolist() == [0.0, 0.0]


def test_entropy_coefficient_semantics():
    per_token = torch.tensor([[0.5, -0.25, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    entropy = torch.tensor([[2.0, 1.0, float("nan")]])
    kl = torch.tensor([[0.1, 0.3, float("inf")]])
    base = (0.5 - 0.25) / 2  # token mean over the two response tokens
    assert policy_objective(per_token, mask, "token_mean", 2.0).item() == pytest.approx(base)
    # unset and 0: the entropy does not enter the loss
    for coef in (None, 0.0):
        assert policy_objective(per_token, mask, "token_mean", 2.0, entropy=entropy, entropy_coef=coef).item() == pytest.approx(base)
    # > 0: subtracted, aggregated like the policy loss: 0.01 * (2 + 1) / 2
    assert policy_objective(per_token, mask, "token_mean", 2.0, entropy=entropy, entropy_coef=0.01).item() == pytest.approx(base - 0.015)
    # KL as a loss term: + coef * mean KL; junk at the masked position stays out of every term
    got = policy_objective(per_token, mask, "token_mean", 2.0, kl=kl, kl_coef=0.5, entropy=entropy, entropy_coef=0.01)
    assert got.item() == pytest.approx(base + 0.5 * 0.2 - 0.015)


def test_the_gae_estimator_whitens_the_advantages_but_returns_advantages_plus_values():
    values = torch.full((4, 3), 0.25, dtype=torch.float64)
    adv_out, ret = ADVANTAGE_ESTIMATORS["gae"](AdvantageInput(SCORES, MASK, group_size=2, values=values, gamma=1.0, lambd=1.0))
    # gamma = lambda = 1: the return is the score on every response token; the advantage whitens score - value
    assert torch.allclose(ret, spread(SCORES.tolist()))
    raw = (spread(SCORES.tolist()) - 0.25) * MASK
    n = MASK.sum()
    mean = (raw * MASK).sum() / n
    std = torch.sqrt((((raw - mean) * MASK) ** 2).sum() / n)
    assert torch.allclose(adv_out, (raw - mean) / std * MASK, atol=1e-6)
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        ADVANTAGE_ESTIMATORS["gae"](AdvantageInput(SCORES, MASK, group_size=2))
