"""The weight broadcast's pieces on a real gloo group (two ranks in one process): buckets, bit-exact transfer, the
names and values the learner side sends (LoRA merged as peft merges it)."""

import threading

import pytest
import torch

from stages.common.launcher import free_port
from stages.rl.broadcast import buckets, named_weights, open_group, receive, send, weight_meta


def _pair():
    """Rank 0 and rank 1 of a fresh gloo group on loopback."""
    port, groups = free_port(), {}

    def join(rank):
        groups[rank] = open_group("127.0.0.1", port, rank, 2, "gloo", 30)

    t = threading.Thread(target=join, args=(1,))
    t.start()
    join(0)
    t.join()
    return groups[0], groups[1]


def test_buckets_are_consecutive_and_bounded_and_a_large_tensor_goes_alone():
    meta = [("a", [10], "float32"), ("b", [10], "float32"), ("c", [100], "float32"), ("d", [5], "bfloat16"), ("e", [1], "float32")]
    # 40 + 40 bytes fit in 100; c (400 bytes) alone; d (10) and e (4) together
    assert buckets(meta, 100) == [[0, 1], [2], [3, 4]]
    assert buckets(meta, 10**9) == [[0, 1, 2, 3, 4]]
    assert buckets(meta, 1) == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize("bucket_bytes", [64, 2**20], ids=["many_buckets", "one_bucket"])
def test_every_tensor_arrives_bit_exact_in_the_senders_dtype(bucket_bytes):
    torch.manual_seed(0)
    weights = [("embed.weight", torch.randn(7, 5)), ("layer.bias", torch.randn(3)), ("head.weight", torch.randn(4, 6))]
    meta = [(n, list(t.shape), "bfloat16") for n, t in weights]
    sender, receiver = _pair()
    got, sent = [], {}
    t = threading.Thread(target=lambda: sent.update(n=send(sender, iter(weights), meta, torch.device("cpu"), bucket_bytes)))
    t.start()
    for name, tensor in receive(receiver, meta, torch.device("cpu"), bucket_bytes):
        got.append((name, tensor.clone()))
    t.join()
    assert sent["n"] == len(buckets(meta, bucket_bytes))
    assert [n for n, _ in got] == [n for n, _ in weights]
    for (_, ours), (_, theirs) in zip(got, weights, strict=True):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs.to(torch.bfloat16))


def test_a_sender_out_of_step_with_the_receivers_list_is_an_error_not_garbage():
    sender, receiver = _pair()
    meta = [("a", [2], "float32")]
    box = {}

    def drain():
        try:
            list(receive(receiver, meta, torch.device("cpu"), 2**20))
        except Exception as e:  # noqa: BLE001
            box["receiver"] = e

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match=r"weight sync: sending b \[3\] where the receivers expect a \[2\]"):
        send(sender, iter([("b", torch.zeros(3))]), meta, torch.device("cpu"), 2**20)


def test_the_learner_sends_the_base_models_names_and_loras_merged_weights(micro_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32)
    plain = dict(named_weights(base, is_peft=False, zero3=False))
    assert set(plain) == {n for n, _ in base.named_parameters()}  # tied weights once
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()  # a non-zero update, as after training
    merged = dict(named_weights(peft, is_peft=True, zero3=False))
    reference = peft.merge_and_unload()
    assert list(merged) == [n for n, *_ in weight_meta(peft, True, False, "float32")]
    assert set(merged) == {n for n, _ in reference.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.allclose(merged[name], p, atol=1e-6), name
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], plain["model.layers.0.self_attn.q_proj.weight"])
