"""The learner's micro-batches sized by tokens: sorted longest first, cut by a position budget, trimmed of
padding, logits only from the first response token on; the loss and its gradients equal one whole-batch
pass computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stages.common.generation import Completion
from stages.rl.config import RLConfig
from stages.rl.experience import (
    Forward,
    Samples,
    Scores,
    StepPlan,
    make_experience,
    micro_batches,
    updates_of,
)
from stages.rl.learner import Learner


def test_rows_are_cut_by_the_position_budget_and_split_to_a_common_count():
    lengths = [10, 9, 8, 3, 3, 2]
    assert micro_batches(lengths, rows=2, max_tokens=None) == [(0, 2), (2, 4), (4, 6)]
    # 20 positions: 2 rows of 10, 2 rows of 8, then the 2 short rows (6 would fit, 2 are left)
    assert micro_batches(lengths, rows=2, max_tokens=20) == [(0, 2), (2, 4), (4, 6)]
    assert micro_batches(lengths, rows=2, max_tokens=5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    # another rank needs 4: the costliest range (2 x 10 positions) is halved first
    assert micro_batches(lengths, rows=2, max_tokens=20, count=4) == [(0, 1), (1, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="cannot cut 2 rows into 3 micro-batches"):
        micro_batches([4, 4], rows=2, max_tokens=None, count=3)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=96, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def test_token_budget_micro_batches_give_the_whole_batch_loss_and_gradients():
    cfg = RLConfig.model_validate({
        "data": {"paths": ["x.jsonl"]},
        "rollout": {"rollout_batch_size": 3, "n_samples_per_prompt": 2, "max_new_tokens": 6, "temperature": 0.7},
        "algo": {"advantage_estimator": "group_norm", "loss_agg": "seq_mean_token_mean", "init_kl_coef": 0.1,
                 "kl_in_reward": False, "kl_estimator": "k3", "entropy_coef": 0.01},
        "train": {"train_batch_size": 6, "micro_train_batch_size": 6, "max_tokens_per_micro_batch": 16},
    })
    plan = StepPlan.of(cfg)
    assert plan.kl_loss and not plan.old_logp
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    groups = [[Completion(p, torch.randint(10, 32, (n,), generator=g).tolist(), "", None) for n in ns]
              for p, ns in zip(prompts, [(6, 2), (1, 5), (3, 4)])]
    s = Samples.of([0, 1, 2], groups, pad_id=0, with_logp=False)
    ref_logp = torch.where(s.response_mask.bool(), -3.0 - torch.rand(s.input_ids.shape, generator=g), 0.0)  # near the model: k3 not clamped
    exp = make_experience(plan, cfg, s, Scores.of({"rewards": torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 1.0]), "scores": torch.zeros(6)}),
                          Forward(None, ref_logp, None), kl_coef=0.1)
    [[share]] = updates_of(exp, cfg, n_ranks=1)
    # lengths sorted 9, 8, 7, 7, 5, 3; 16 positions: 1 row of 9, 2 of 8, 2 of 7, then the last row
    assert share.attention_mask.sum(-1).tolist() == [9, 8, 7, 7, 5, 3]
    assert share.micro == ((0, 1), (1, 3), (3, 5), (5, 6))
    learner = Learner(0, 1)
    learner.cfg, learner.plan = cfg, plan

    ours = _model()
    total = 0.0
    for a, b in share.micro:
        loss, _ = learner.micro_loss(ours, share.rows(a, b).trimmed(), kl_coef=0.1)
        loss.backward()
        total += float(loss.detach())

    # by hand, one pass over the padded batch: full logits / T, token t drawn from the logits at t - 1
    whole = _model()
    logits = whole(input_ids=s.input_ids, attention_mask=s.attention_mask).logits[:, :-1] / 0.7
    logp_all = torch.log_softmax(logits, -1)
    logp = torch.cat([torch.zeros(6, 1), logp_all.gather(-1, s.input_ids[:, 1:, None]).squeeze(-1)], 1)
    entropy = torch.cat([torch.zeros(6, 1), -(logp_all.exp() * logp_all).sum(-1)], 1)
    mask = s.response_mask.float()
    ratio = torch.exp(logp - logp.detach())
    log_ratio = ref_logp - logp
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    per_seq = lambda x: ((x * mask).sum(-1) / mask.sum(-1)).sum() / 6  # noqa: E731
    expected = per_seq(-exp.advantages * ratio) + 0.1 * per_seq(k3) - 0.01 * per_seq(entropy)
    expected.backward()

    assert total == pytest.approx(float(expected.detach()), abs=1e-5)
    for (name, p), q in zip(ours.named_parameters(), whole.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=0), name


def test_sync_check_counts_only_tokens_the_learner_finds_likely():
    from stages.common.logprobs import logprob_difference

    learner = torch.tensor([math.log(0.5), math.log(0.2), math.log(1e-4), math.log(0.9)])
    engine = learner + torch.tensor([0.01, -0.03, 2.0, 0.02])  # the unlikely token moved most (bf16 rounding)
    mean, worst, counted = logprob_difference(engine, learner, min_prob=1e-3)
    assert counted == 3
    assert mean == pytest.approx((0.01 + 0.03 + 0.02) / 3, abs=1e-6) and worst == pytest.approx(0.03, abs=1e-6)
    mean, worst, counted = logprob_difference(engine, learner, min_prob=0.0)  # every token
    assert counted == 4 and mean == pytest.approx((0.01 + 0.03 + 2.0 + 0.02) / 4, abs=1e-6) and worst == pytest.approx(2.0)
    assert logprob_difference(engine, learner, min_prob=0.95) == (0.0, 0.0, 0)


@pytest.mark.parametrize("kind", ["tis", "icepop"])
def test_the_learners_loss_weights_each_token_by_the_engine_is_correction(kind):
    from stages.rl.algorithms import IS_CORRECTIONS, ISInput

    cfg = RLConfig.model_validate({
        "data": {"paths": ["x.jsonl"]},
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 5},
        "algo": {"advantage_estimator": "dr_grpo", "is_correction": kind, "is_threshold": (0.8, 1.25)},
        "train": {"train_batch_size": 4, "micro_train_batch_size": 4},
    })
    plan = StepPlan.of(cfg)
    assert plan.rollout_logp and not plan.old_logp
    g = torch.Generator().manual_seed(2)
    groups = [[Completion(p, torch.randint(10, 32, (n,), generator=g).tolist(), "", None) for n in ns]
              for p, ns in zip([[1, 2], [3, 4, 5]], [(5, 2), (3, 4)])]
    learner = Learner(0, 1)
    learner.cfg, learner.plan = cfg, plan
    model = _model()
    # the engine's log-probs: the model's own, moved by up to +-0.4 nats (some ratios outside [0.8, 1.25])
    s0 = Samples.of([0, 1], groups, pad_id=0, with_logp=False)
    with torch.no_grad():
        own = learner._forward_logps(model, s0.input_ids, s0.attention_mask)
    for k, c in enumerate(c for grp in groups for c in grp):
        start = len(c.prompt_ids)
        c.logprobs = (own[k, start : start + len(c.token_ids)] + (torch.rand(len(c.token_ids), generator=g) - 0.5) * 0.8).tolist()
    s = Samples.of([0, 1], groups, pad_id=0, with_logp=True)
    exp = make_experience(plan, cfg, s, Scores.of({"rewards": torch.tensor([1.0, 0.0, 0.0, 2.0]), "scores": torch.zeros(4)}),
                          Forward(None, None, None), kl_coef=0.0)
    [[share]] = updates_of(exp, cfg, n_ranks=1)
    loss, metrics = learner.micro_loss(model, share, kl_coef=0.0)
    mask = s.response_mask.float()
    logp = learner._forward_logps(model, s.input_ids, s.attention_mask).detach()
    w = IS_CORRECTIONS[kind](ISInput(logp, s.rollout_logp, mask, 0.8, 1.25))
    assert 0 < int(((w > 0) & ((w - 1).abs() > 1e-6)).sum()) and (kind != "icepop" or bool(((w == 0) & mask.bool()).any()))
    expected = (-exp.advantages * w * mask).sum() / mask.sum()  # ratio 1 on-policy; token_mean
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-6)
    assert metrics["vllm_kl"] == pytest.approx(float(((s.rollout_logp - logp) * mask).sum()), abs=1e-5)
