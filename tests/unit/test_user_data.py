"""A user's own data, in the shapes people download: chat-message and transcript preference pairs, score
margins, and malformed JSONL files named by line and reason before any work starts."""

import json
from pathlib import Path

import pytest

from datasets_prep.loading import DataConfig, DataError, load_rows
from datasets_prep.preference import prepare_pairs

Q, GOOD, BAD = "What is 12+30?", "12+30 = 42", "12+30 = 32"


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ids(pairs):
    return [(p.prompt_ids, p.chosen_ids, p.rejected_ids, p.margin) for p in pairs]


def test_ultrafeedback_and_message_pairs_give_the_prompt_response_tokens(tmp_path, tokenizer):
    user = {"role": "user", "content": Q}
    plain = _write(tmp_path / "plain.jsonl", [{"prompt": Q, "chosen": GOOD, "rejected": BAD}])
    # UltraFeedback-binarized: a prompt column and full conversations; trl-lib style: conversations only
    uf = _write(tmp_path / "uf.jsonl", [{"prompt": Q, "chosen": [user, {"role": "assistant", "content": GOOD}],
                                         "rejected": [user, {"role": "assistant", "content": BAD}], "score_chosen": 8.5,
                                         "score_rejected": 3.0}])
    conv = _write(tmp_path / "conv.jsonl", [{"chosen": [user, {"role": "assistant", "content": GOOD}],
                                             "rejected": [user, {"role": "assistant", "content": BAD}]}])
    # explicit prompt messages with assistant-only responses
    split = _write(tmp_path / "split.jsonl", [{"prompt": [user], "chosen": [{"role": "assistant", "content": GOOD}],
                                               "rejected": [{"role": "assistant", "content": BAD}]}])
    want = _ids(prepare_pairs(DataConfig(paths=[str(plain)]), tokenizer)[0])
    assert tokenizer.decode(want[0][0]) == f"<|bos|><|user|>{Q}<|end|><|assistant|>"
    assert tokenizer.decode(want[0][1]) == f"{GOOD}<|end|>"
    for path in (conv, split):
        assert _ids(prepare_pairs(DataConfig(paths=[str(path)]), tokenizer)[0]) == want, path.name
    for prompt_key in ("prompt", None):
        got = _ids(prepare_pairs(DataConfig(paths=[str(uf)], prompt_key=prompt_key), tokenizer)[0])
        assert got == want
    # the margin from the score columns: 8.5 - 3.0
    scored = prepare_pairs(DataConfig(paths=[str(uf)], score_keys=("score_chosen", "score_rejected")), tokenizer)[0]
    assert scored[0].margin == 5.5 and _ids(scored)[0][:3] == want[0][:3]


def test_hh_transcripts_split_at_the_last_assistant_marker(tmp_path, tokenizer):
    turn1 = "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: " + Q + "\n\nAssistant:"
    hh = _write(tmp_path / "hh.jsonl", [{"chosen": turn1 + " 42", "rejected": turn1 + " 32"},
                                        # the responses share their start: the prompt still ends at the marker
                                        {"chosen": turn1 + " It is 42", "rejected": turn1 + " It is 32"}])
    plain = _write(tmp_path / "plain.jsonl", [{"prompt": turn1, "chosen": " 42", "rejected": " 32"},
                                              {"prompt": turn1, "chosen": " It is 42", "rejected": " It is 32"}])
    raw = {"apply_chat_template": False, "max_len": 256}
    got = _ids(prepare_pairs(DataConfig(paths=[str(hh)], prompt_key=None, **raw), tokenizer)[0])
    want = _ids(prepare_pairs(DataConfig(paths=[str(plain)], **raw), tokenizer)[0])
    assert got == want
    assert tokenizer.decode(got[1][0]).endswith(f"{Q}\n\nAssistant:")
    assert tokenizer.decode(got[1][1]).startswith(" It is 42")
    # with the default prompt_key the missing column is named, with the way out
    with pytest.raises(DataError, match=r"hh.jsonl row 1: key 'prompt' missing \(prompt_key='prompt'\); for transcripts "
                                        r"with no prompt column set prompt_key: null"):
        prepare_pairs(DataConfig(paths=[str(hh)], **raw), tokenizer)


@pytest.mark.parametrize(
    "row, kw, message",
    [
        ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
          "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "c"}]}, {},
         r"p.jsonl row 1: 'chosen' and 'rejected' share no leading messages"),
        ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}, {"role": "user", "content": "more"}],
          "rejected": [{"role": "assistant", "content": "c"}]}, {},
         r"p.jsonl row 1: field 'chosen' has \['assistant', 'user'\] after the prompt; expected one assistant message"),
        ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}, {},
         r"p.jsonl row 1: 'chosen' is a list but 'rejected' is a str"),
        ({"chosen": "same text", "rejected": "other"}, {"prompt_key": None}, r"p.jsonl row 1: 'chosen' and 'rejected' share no prefix"),
        ({"prompt": "a", "chosen": "b", "rejected": "c", "sc": 1.0, "sr": "low"}, {"score_keys": ("sc", "sr")},
         r"p.jsonl row 1: field 'sr' is 'low'; expected a number \(score_keys=\['sc', 'sr'\]\)"),
    ],
)
def test_bad_pair_shapes_are_named(tmp_path, tokenizer, row, kw, message):
    path = _write(tmp_path / "p.jsonl", [row])
    with pytest.raises(DataError, match=message):
        prepare_pairs(DataConfig(paths=[str(path)], **kw), tokenizer)


GOOD_LINE = json.dumps({"input": "1+1", "output": "2"})


@pytest.mark.parametrize(
    "lines, message",
    [
        ([GOOD_LINE, GOOD_LINE, '{"input": "1+2", "output": 3'],
         r"d.jsonl line 3: not valid JSON \(Expecting ',' delimiter, column 29; line starts '\{\"input\": \"1\+2\", \"output\": 3'\)"),
        ([GOOD_LINE, "[1, 2]"], r"d.jsonl line 2: a JSON array \(\[1, 2\]\); expected an object with named fields"),
        ([GOOD_LINE, '"just text"'], r"d.jsonl line 2: a JSON string .*expected an object"),
        ([GOOD_LINE, GOOD_LINE, GOOD_LINE, json.dumps({"input": "1+3", "output": [4]})],
         r"d.jsonl line 4: field 'output' is a JSON array \(value \[4\]\); it is a string in line 1, and a column holds one type"),
        # a number after strings: datasets would coerce it to "5" silently, or report another row
        ([GOOD_LINE, "", json.dumps({"input": "2+3", "output": 5})],
         r"d.jsonl line 3: field 'output' is a JSON number \(value 5\); it is a string in line 1"),
    ],
)
def test_malformed_jsonl_lines_are_named_before_loading(tmp_path, lines, message):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        load_rows(DataConfig(paths=[str(path)]))


def test_bad_utf8_and_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes((GOOD_LINE + "\n").encode() + b'{"input": "caf\xe9", "output": "x"}\n')
    with pytest.raises(DataError, match=r"d.jsonl line 2: not UTF-8 text \(byte 0xe9 at column 15\)"):
        load_rows(DataConfig(paths=[str(path)]))
    # a row's check names its line when blank lines shift rows from lines
    path.write_text(GOOD_LINE + "\n\n\n" + json.dumps({"input": "", "output": "2"}) + "\n")
    from datasets_prep.sft import check_sft_row

    cfg = DataConfig(paths=[str(path)])
    with pytest.raises(DataError, match=r"d.jsonl row 2 \(line 4\): field 'input' is an empty string"):
        load_rows(cfg, check_sft_row(cfg))
    # a .json array: items are named
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"input": "a", "output": "b"}, 7]))
    with pytest.raises(DataError, match=r"a.json item 2: a JSON number \(7\); expected an object"):
        load_rows(DataConfig(paths=[str(arr)]))
