import pytest
import torch

from checkpoints import read_manifest, verify
from stages.tiny_model import PRESETS, TinyModelConfig, run_tiny_model


def test_micro_model_loads_with_auto_classes(micro_model, tokenizer):
    from transformers import AutoModelForCausalLM

    m = read_manifest(micro_model.path)
    assert m.kind == "full" and m.stage == "tiny_model"
    model = AutoModelForCausalLM.from_pretrained(micro_model.path)
    n = sum(p.numel() for p in model.parameters())
    assert 200_000 < n < 900_000 and n == m.extra["parameters"]
    hidden, layers, heads, _ = PRESETS["micro"]
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|end|>")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "7+8"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    out = model(input_ids=torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), len(tokenizer))


def test_factory_is_deterministic_and_cached(store, micro_model):
    again = run_tiny_model(TinyModelConfig(preset="micro", output_root=str(store)))
    assert again == micro_model  # committed once, found again by its config
    verify(again)


def test_tiny_preset_is_in_the_documented_size_range(tmp_path):
    from stages.tiny_model import build_model, build_tokenizer

    model = build_model(TinyModelConfig(preset="tiny"), build_tokenizer())
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="preset"):
        TinyModelConfig(preset="huge")
