import json
from pathlib import Path

import pytest
import torch

from datasets_prep.loading import DataConfig, DataError
from datasets_prep.preference import collate_pairs, pack_pairs, prepare_pairs, tokenize_pair
from stages.common.preference_losses import PolicyPair, dpo_loss
from stages.dpo import pair_logps


def _cfg(path, **kw):
    return DataConfig(paths=[str(path)], **kw)


def _write(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def perturbed(micro_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(micro_model.path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_pair_tokens_share_the_prompt_and_end_the_turn(tokenizer):
    p = tokenize_pair({"prompt": "1+2", "chosen": "3", "rejected": "4"}, tokenizer, _cfg("x"))
    assert tokenizer.decode(p.prompt_ids) == "<|bos|><|user|>1+2<|end|><|assistant|>"
    assert tokenizer.decode(p.chosen_ids) == "3<|end|>" and tokenizer.decode(p.rejected_ids) == "4<|end|>"


def test_packed_pairs_give_the_same_logps_and_dpo_loss_as_padded(task_files, tokenizer, perturbed):
    pairs, _ = prepare_pairs(_cfg(task_files["preference"], max_len=64), tokenizer)
    pairs = pairs[:9]
    rows = pack_pairs(pairs, 128)  # worked answers make a pair 30-90 tokens long
    assert 1 < len(rows) < len(pairs)
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        c1, r1, n1 = pair_logps(perturbed, collate_pairs(pairs, pad))
        c2, r2, n2 = pair_logps(perturbed, collate_pairs(rows, pad))
        singles = [pair_logps(perturbed, collate_pairs([p], pad)) for p in pairs]
    assert torch.allclose(c1, c2, atol=1e-5) and torch.allclose(r1, r2, atol=1e-5) and torch.equal(n1, n2)
    assert torch.allclose(c1, torch.cat([s[0] for s in singles]), atol=1e-5)
    assert n1.tolist() == [len(p.chosen_ids) for p in pairs]
    ref = (c1.detach() - 0.3, r1.detach() + 0.2)
    loss_a = dpo_loss("dpo")(PolicyPair(c1, r1, *ref, beta=0.1)).sum()
    loss_b = dpo_loss("dpo")(PolicyPair(c2, r2, *ref, beta=0.1)).sum()
    assert abs(loss_a.item() - loss_b.item()) < 1e-5


def test_reward_score_is_the_same_with_left_and_right_padding(micro_model, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from stages.reward_model import score_padded

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(micro_model.path, num_labels=1, dtype=torch.float32).eval()
    seqs = [tokenizer("12+30")["input_ids"], tokenizer("7+8=15 and more")["input_ids"]]
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id

    def batch(left: bool):
        ids = torch.full((2, width), pad)
        mask = torch.zeros((2, width), dtype=torch.long)
        for i, s in enumerate(seqs):
            sl = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, sl] = torch.tensor(s)
            mask[i, sl] = 1
        return ids, mask

    with torch.no_grad():
        right = score_padded(rm, *batch(False))
        left = score_padded(rm, *batch(True))
        alone = torch.cat([score_padded(rm, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in seqs])
        hf = rm(*batch(False)[:1], attention_mask=batch(False)[1]).logits.squeeze(-1)  # HF's own pooling
    assert torch.allclose(left, right, atol=1e-5) and torch.allclose(right, alone, atol=1e-5)
    assert torch.allclose(hf, right, atol=1e-5)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1+1", "chosen": "2", "rejected": "2"}, r"p.jsonl row 2: 'chosen' equals 'rejected' \('2'\)"),
        ({"prompt": "1+1", "chosen": "2"}, r"p.jsonl row 2: key 'rejected' missing \(rejected_key='rejected'"),
        ({"prompt": "1+1", "chosen": "", "rejected": "3"}, r"p.jsonl row 2: field 'chosen' is an empty string"),
        ({"prompt": "1+1", "chosen": "2", "rejected": "  "}, r"p.jsonl row 2: field 'rejected' is an empty string"),
    ],
)
def test_bad_pairs_are_named(tmp_path, tokenizer, row, message):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "2+2", "chosen": "4", "rejected": "5"}, row])
    with pytest.raises(DataError, match=message):
        prepare_pairs(_cfg(path), tokenizer)


HH = {"chosen": "\n\nHuman: what is 1+2?\n\nAssistant: 3", "rejected": "\n\nHuman: what is 1+2?\n\nAssistant: 4"}


def test_transcripts_without_a_prompt_column_are_one_user_turn_or_used_as_they_are(tokenizer):
    """HH-style transcripts (prompt_key: null): the prompt is the shared prefix up to the last prompt_marker. With
    the chat template (the default) that prefix becomes one user turn; apply_chat_template: false keeps the
    transcript's own role markers, the text as it is, and ends each response with the EOS token."""
    wrapped = tokenize_pair(HH, tokenizer, _cfg("x", prompt_key=None))
    assert tokenizer.decode(wrapped.prompt_ids) == "<|bos|><|user|>\n\nHuman: what is 1+2?\n\nAssistant:<|end|><|assistant|>"
    assert tokenizer.decode(wrapped.chosen_ids) == " 3<|end|>"
    plain = tokenize_pair(HH, tokenizer, _cfg("x", prompt_key=None, apply_chat_template=False))
    assert plain.prompt_ids == tokenizer("\n\nHuman: what is 1+2?\n\nAssistant:", add_special_tokens=False)["input_ids"]
    assert plain.chosen_ids == tokenizer(" 3" + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert plain.rejected_ids == tokenizer(" 4" + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
