import json
import random
from pathlib import Path

import pytest

from datasets_prep.loading import DataConfig, DataError, load_rows
from datasets_prep.sft import prepare_sft, tokenize_sft_row
from datasets_prep.synthetic import (
    WORKED_PREFIX,
    column_add,
    generate,
    is_correct,
    worked_answer,
    write_task_files,
    wrong_worked_answer,
)

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"q": f"{i}+1", "a": str(i + 1)} for i in range(10)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(paths, **kw) -> DataConfig:
    return DataConfig(paths=paths, input_key="q", output_key="a", **kw)


def test_every_file_format_and_save_to_disk_load_the_same_rows(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    _jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "saved_dict"))
    for name in ("d.jsonl", "d.json", "d.parquet", "d.csv", "saved", "saved_dict"):
        rows = load_rows(_cfg([str(tmp_path / name)]))
        assert [{"q": r["q"], "a": str(r["a"])} for r in rows] == ROWS, name
    assert len(load_rows(_cfg([str(tmp_path / "saved_dict")], split="test"))) == 2


def test_mixing_with_probabilities_and_max_samples(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"q": f"a{i}", "a": "x"} for i in range(300)])
    b = _jsonl(tmp_path / "b.jsonl", [{"q": f"b{i}", "a": "y"} for i in range(300)])
    rows = load_rows(_cfg([str(a), str(b)], dataset_probs=[0.8, 0.2], max_samples=200))
    assert len(rows) == 200
    share_a = sum(r["q"].startswith("a") for r in rows) / len(rows)
    assert 0.7 < share_a < 0.9
    with pytest.raises(ValueError, match="dataset_probs: 1 values for 2 paths"):
        _cfg([str(a), str(b)], dataset_probs=[1.0])


@pytest.mark.parametrize(
    "rows, kw, message",
    [
        ([{"q": "1+1"}], {}, r"d.jsonl row 1: key 'a' missing \(output_key='a'"),
        ([{"q": "1+1", "a": "2"}, {"q": "", "a": "3"}], {}, r"d.jsonl row 2: field 'q' is an empty string; expected text \(input_key='q'\)"),
        ([{"q": 5, "a": "2"}], {}, r"d.jsonl row 1: field 'q' has type int \(value 5\); expected a string or a list of chat messages"),
        ([{"q": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}], {"output_key": None}, r"message 1: content ' ' must be non-empty text"),
        ([{"q": [{"role": "robot", "content": "hi"}]}], {"output_key": None}, r"d.jsonl row 1: field 'q' message 0: unknown role 'robot'"),
    ],
)
def test_bad_rows_are_named(tmp_path, tokenizer, rows, kw, message):
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(paths=[str(path)], **{"input_key": "q", "output_key": "a", **kw})
    with pytest.raises(DataError, match=message):
        prepare_sft(cfg, tokenizer)


def test_empty_and_missing_datasets_are_named(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        prepare_sft(_cfg([str(empty)]), tokenizer)
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        prepare_sft(_cfg([str(tmp_path / "nope.jsonl")]), tokenizer)


def test_prompt_is_masked_and_response_ends_with_end_of_turn(tokenizer):
    cfg = _cfg(["unused"])
    ex = tokenize_sft_row({"q": "12+30", "a": "42"}, tokenizer, cfg)
    toks = tokenizer.convert_ids_to_tokens(ex.input_ids)
    assert toks == ["<|bos|>", "<|user|>", "1", "2", "+", "3", "0", "<|end|>", "<|assistant|>", "4", "2", "<|end|>"]
    assert ex.loss_mask == [0] * 9 + [1, 1, 1]
    # a plain input_template instead of the chat template: the response gets EOS appended
    ex = tokenize_sft_row({"q": "1+1", "a": "2"}, tokenizer, _cfg(["x"], apply_chat_template=False, input_template="Q: {} A: "))
    assert tokenizer.decode(ex.input_ids) == "Q: 1+1 A: 2<|end|>"
    assert tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m]) == "2<|end|>"
    # pretrain mode: everything is a target
    ex = tokenize_sft_row({"q": "1+1=2"}, tokenizer, _cfg(["x"], pretrain_mode=True))
    assert all(ex.loss_mask)


def test_multi_turn_loss_only_on_assistant_turns(tokenizer):
    conv = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    ex = tokenize_sft_row({"m": conv}, tokenizer, DataConfig(paths=["x"], input_key="m", output_key=None))
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(conv, tokenize=False)
    trained = [tokenizer.convert_ids_to_tokens(t) for t, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert trained == ["2", "<|end|>", "4", "<|end|>"]


def test_length_policy_counts_truncated_and_dropped(tmp_path, tokenizer):
    rows = [{"q": "1+1", "a": "2"}, {"q": "1" * 40 + "+1", "a": "2"}, {"q": "3+3", "a": "6" * 30}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    ex, rep = prepare_sft(_cfg([str(path)], max_len=20, overflow="drop"), tokenizer)
    assert (rep.rows, rep.kept, rep.dropped, rep.truncated) == (3, 1, 2, 0)
    ex, rep = prepare_sft(_cfg([str(path)], max_len=20, overflow="truncate"), tokenizer)
    # row 2 loses its whole response to truncation, so it is dropped as having no target left
    assert (rep.kept, rep.truncated, rep.dropped) == (2, 2, 1)
    assert all(len(e.input_ids) <= 20 for e in ex)


def test_task_is_deterministic_and_shipped_files_match_the_generator(tmp_path):
    assert generate(seed=0) == generate(seed=0)
    assert generate(seed=0) != generate(seed=1)
    data = generate(seed=0)
    eval_prompts = {r["prompt"] for r in data["eval"]}
    train_prompts = {r["messages"][0]["content"] for r in data["sft"]} | {r["prompt"] for r in data["rl_prompts"]}
    assert not eval_prompts & train_prompts
    for r in data["preference"] + data["preference_eval"]:
        total = str(sum(int(x) for x in r["prompt"].split("+")))
        assert r["chosen"] == worked_answer(r["prompt"]) and is_correct(r["chosen"], total), r
        assert not is_correct(r["rejected"], total), r
    slips = sum(r["rejected"].startswith(WORKED_PREFIX) for r in data["preference"])
    assert 0.05 < slips / len(data["preference"]) < 0.15
    worked = sum(r["messages"][1]["content"].startswith(WORKED_PREFIX) for r in data["sft"])
    assert 0.25 < worked / len(data["sft"]) < 0.35
    written = write_task_files(tmp_path, seed=0)
    for split, path in written.items():
        assert path.read_text() == (ROOT / "data" / "arithmetic" / f"{split}.jsonl").read_text(), split
    assert is_correct("The sum is 42.", "42") and not is_correct("41", "42") and not is_correct("", "42")


def test_worked_answers_by_hand():
    assert worked_answer("57+68") == "Work: 7+8=15, 5+6+1=12, so 125"
    assert worked_answer("9+42") == "Work: 9+2=11, 0+4+1=5, so 51"
    assert worked_answer("999+1") == "Work: 9+1=10, 9+0+1=10, 9+0+1=10, so 1000"
    assert worked_answer("3+4") == "Work: 3+4=7, so 7"
    # slips are carried through to the sum, as a person making them would
    assert column_add("57+68", drop_carry_at=1) == (["7+8=15", "5+6=11"], "115")
    assert column_add("57+68", slip_at=0, slip=-1) == (["7+8=14", "5+6+1=12"], "124")
    assert column_add("95+7", slip_at=1, slip=1) == (["5+7=12", "9+0+1=11"], "112")
    rng = random.Random(0)
    for prompt in ["0+0", "5+5", "57+68", "999+999", "100+900", "1+0"]:
        total = str(sum(int(x) for x in prompt.split("+")))
        for _ in range(20):
            wrong = wrong_worked_answer(prompt, rng)
            assert wrong.startswith(WORKED_PREFIX) and not is_correct(wrong, total), (prompt, wrong)
    # the answer is the last integer in both forms
    assert is_correct("125", "125") and is_correct(worked_answer("57+68"), "125")
    assert not is_correct("Work: 7+8=15, 5+6+1=12", "125")


def test_an_oversized_row_is_bounded_before_it_is_tokenized(tmp_path, tokenizer):
    """A 10 MB row is dropped (or clipped) by its character count, never rendered or tokenized whole; a
    row under the bound goes through the token length policy as before, and its tokens are unchanged."""
    import time

    from datasets_prep.preference import prepare_pairs
    from datasets_prep.sft import char_bound

    bound = char_bound(tokenizer, 20)
    assert bound == 20 * max(len(t) for t in tokenizer.get_vocab())
    huge = "7" * 10_000_000
    path = _jsonl(tmp_path / "d.jsonl", [{"q": "1+1", "a": "2"}, {"q": huge, "a": "2"}, {"q": "2+2", "a": huge}])
    t = time.perf_counter()
    ex, rep = prepare_sft(_cfg([str(path)], max_len=20, overflow="drop"), tokenizer)
    assert (rep.kept, rep.dropped, rep.clipped) == (1, 2, 0)
    assert ex[0].input_ids == tokenize_sft_row({"q": "1+1", "a": "2"}, tokenizer, _cfg([str(path)])).input_ids
    ex, rep = prepare_sft(_cfg([str(path)], max_len=20, overflow="truncate"), tokenizer)
    # row 2: its prompt alone fills max_len (nothing left to learn: dropped); row 3: clipped, then truncated
    assert (rep.kept, rep.clipped, rep.truncated, rep.dropped) == (2, 2, 2, 1) and all(len(e.input_ids) <= 20 for e in ex)
    pairs_path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1", "chosen": "2", "rejected": "3"},
                                               {"prompt": "1+1", "chosen": huge, "rejected": "3"}])
    pairs, rep = prepare_pairs(DataConfig(paths=[str(pairs_path)], max_len=20, overflow="drop"), tokenizer)
    assert (rep.kept, rep.dropped) == (1, 1)
    assert time.perf_counter() - t < 20  # the old path rendered and tokenized 30 MB of text (minutes, GBs)
