import torch

from datasets_prep.loading import DataConfig
from datasets_prep.packing import BatchSchedule, collate, loss_tokens, pack
from datasets_prep.sft import tokenize_sft_row
from stages.common.logprobs import masked_sum, token_logps


def _examples(tokenizer, n=7):
    cfg = DataConfig(paths=["x"], input_key="q", output_key="a")
    return [tokenize_sft_row({"q": f"{i * 37}+{i * 11}", "a": str(i * 48)}, tokenizer, cfg) for i in range(1, n + 1)]


def _nll(model, batch):
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
    logits = model(**inputs, use_cache=False).logits
    return -masked_sum(token_logps(logits, batch["input_ids"]), batch["loss_mask"])


def test_packed_loss_equals_unpadded_per_sample_loss(micro_model, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32).eval()
    with torch.no_grad():  # perturb the random init so the check is not on near-uniform logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    examples = _examples(tokenizer)
    rows = pack(examples, max_len=40)
    assert 1 < len(rows) < len(examples)  # several examples share a row
    with torch.no_grad():
        per_sample = sum(_nll(model, collate([ex], tokenizer.pad_token_id)) for ex in examples)
        packed = _nll(model, collate(rows, tokenizer.pad_token_id))
        padded = _nll(model, collate(examples, tokenizer.pad_token_id))
    assert abs(packed.item() - per_sample.item()) < 1e-5 * max(1.0, abs(per_sample.item()))
    assert abs(padded.item() - per_sample.item()) < 1e-5 * max(1.0, abs(per_sample.item()))
    assert sum(loss_tokens(r) for r in rows) == sum(loss_tokens(e) for e in examples)


def test_packing_positions_restart_and_attention_stays_inside_each_sample(micro_model, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32).eval()
    a, b = _examples(tokenizer, 2)
    (row,) = pack([a, b], max_len=64)
    assert row.position_ids == list(range(len(a.input_ids))) + list(range(len(b.input_ids)))
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([b.input_ids])).logits[0]
        batch = collate([row], tokenizer.pad_token_id)
        together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    assert torch.allclose(together[len(a.input_ids) :], alone, atol=1e-5)


def test_token_logps_by_hand():
    # vocab 2, one sequence [0, 1, 1]; logits at t=0 favour token 1 by ln(3), at t=1 are equal
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0))], [0.0, 0.0], [5.0, 0.0]]])
    lp = token_logps(logits, torch.tensor([[0, 1, 1]]))
    expected = torch.tensor([[0.0, torch.log(torch.tensor(0.75)), torch.log(torch.tensor(0.5))]])
    assert torch.allclose(lp, expected, atol=1e-6)


def test_schedule_covers_each_item_once_per_epoch_and_splits_by_rank():
    s = BatchSchedule(num_items=40, train_batch_size=8, micro_batch_size=2, world_size=2, seed=3)
    assert s.accumulation == 2 and s.steps_per_epoch == 5
    epoch0 = [i for step in range(5) for i in s.global_batch(step)]
    assert sorted(epoch0) == list(range(40))
    assert [i for step in range(5, 10) for i in s.global_batch(step)] != epoch0  # reshuffled
    step = 7
    by_rank = [i for r in range(2) for mb in s.micro_batches(step, r) for i in mb]
    assert by_rank == s.global_batch(step)
    assert BatchSchedule(40, 8, 2, 2, 3).global_batch(step) == s.global_batch(step)  # pure
