"""Preference losses against numbers worked out by hand (sp(x) = log(1 + e^x) = -log sigmoid(-x))."""

import pytest
import torch

from stages.common.preference_losses import PolicyPair, RewardPair, dpo_loss, reward_loss


def t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_sigmoid_reward_loss_with_and_without_margin():
    # r_w - r_l = 1: -log sigmoid(1) = log(1 + e^-1) = 0.313261687518...
    # margin 0.5: -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474076984180...
    # equal rewards: log 2
    out = reward_loss("sigmoid")(RewardPair(t(2.0, 2.0, 0.0), t(1.0, 1.0, 0.0), t(0.0, 0.5, 0.0)))
    assert torch.allclose(out, t(0.31326168751822286, 0.4740769841801067, 0.6931471805599453), atol=1e-12)


def test_logexp_reward_loss():
    # log(1 + exp(r_l - r_w)): r_l - r_w = 2 -> 2.126928011042972; = -1 -> 0.313261687518...
    out = reward_loss("logexp")(RewardPair(t(1.0, 2.0), t(3.0, 1.0), t(0.0, 0.0)))
    assert torch.allclose(out, t(2.1269280110429727, 0.31326168751822286), atol=1e-12)


def _pairs(beta, smoothing=0.0):
    # pair 1: (pc - rc) - (pr - rr) = (-5 + 6) - (-9 + 8) = 2
    # pair 2: (-10 + 10) - (-4 + 6) = -2
    return PolicyPair(t(-5.0, -10.0), t(-9.0, -4.0), t(-6.0, -10.0), t(-8.0, -6.0), beta, smoothing)


def test_dpo_loss_by_hand():
    # beta 0.1: z = 0.2 -> log(1 + e^-0.2) = 0.598138869...; z = -0.2 -> log(1 + e^0.2) = 0.798138869...
    assert torch.allclose(dpo_loss("dpo")(_pairs(0.1)), t(0.5981388693815918, 0.7981388693815918), atol=1e-12)
    # beta 0.5: z = 1 -> 0.313261687...; z = -1 -> log(1 + e) = 1.313261687...
    assert torch.allclose(dpo_loss("dpo")(_pairs(0.5)), t(0.31326168751822286, 1.3132616875182228), atol=1e-12)


def test_cdpo_label_smoothing_by_hand():
    # e = 0.1, z = 0.2: 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.618138869...
    out = dpo_loss("cdpo")(_pairs(0.1, 0.1))
    assert out[0].item() == pytest.approx(0.6181388693815918, abs=1e-12)
    # e = 0.25, z = -1: 0.75 * log(1 + e) + 0.25 * log(1 + e^-1) = 1.063261687...
    out = dpo_loss("cdpo")(_pairs(0.5, 0.25))
    assert out[1].item() == pytest.approx(1.0632616875182228, abs=1e-12)


def test_ipo_by_hand():
    # (h - 1/(2 beta))^2: beta 0.1 -> (2 - 5)^2 = 9, (-2 - 5)^2 = 49; beta 0.25 -> (2 - 2)^2 = 0, (-2 - 2)^2 = 16
    assert torch.allclose(dpo_loss("ipo")(_pairs(0.1)), t(9.0, 49.0), atol=1e-12)
    assert torch.allclose(dpo_loss("ipo")(_pairs(0.25)), t(0.0, 16.0), atol=1e-12)


def test_unknown_loss_lists_the_valid_ones():
    with pytest.raises(ValueError, match="preference loss 'kto' is unknown; valid: cdpo, dpo, ipo"):
        dpo_loss("kto")
    with pytest.raises(ValueError, match="reward-model loss 'hinge' is unknown; valid: logexp, sigmoid"):
        reward_loss("hinge")
