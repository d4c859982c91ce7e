"""The built-in tool task: its data (shipped as generated, eval disjoint, a fifth of the SFT answers calling the
calculator), the tool tokenizer (the call markers one token each, kept when decoded; the default tokenizer
unchanged), the calculator, and the reward on an episode's last answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from datasets_prep.sft import tokenize_sft_row
from datasets_prep.tool_task import TOOL_FRACTION, generate, tool_call, write_tool_task_files
from stages.common.plugins import load_callable
from stages.common.tiny import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_tool_task_files_are_the_generator_s_and_eval_is_held_out(tmp_path):
    data = generate(seed=0)
    for split, path in write_tool_task_files(tmp_path, seed=0).items():
        assert path.read_text() == (ROOT / "data" / "tools" / f"{split}.jsonl").read_text(), split
    eval_prompts = {r["prompt"] for r in data["eval"]}
    assert not eval_prompts & ({r["messages"][0]["content"] for r in data["sft"]} | {r["prompt"] for r in data["rl_prompts"]})
    for r in data["eval"][:50] + data["rl_prompts"][:50]:
        a, b = map(int, r["prompt"].split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and r["answer"] == str(a * b)
    calls = [r for r in data["sft"] if len(r["messages"]) == 4]
    assert abs(len(calls) / len(data["sft"]) - TOOL_FRACTION) < 0.02
    user, call, tool, answer = calls[0]["messages"]
    assert call["content"] == tool_call(user["content"]) and tool["content"] == answer["content"] == data_product(user["content"])


def data_product(prompt: str) -> str:
    a, b = map(int, prompt.split("*"))
    return str(a * b)


def test_the_tool_tokenizer_renders_tools_and_keeps_its_call_markers_while_the_default_one_is_unchanged():
    from datasets_prep.loading import DataConfig
    from datasets_prep.tool_task import schemas

    tok, default = build_tokenizer(tools=True), build_tokenizer()
    assert len(default) == 344  # the embedded default's vocabulary, as before tools existed
    for marker in ("<tool_call>", "</tool_call>", "<|tool|>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1
    ids = tok(tool_call("123*456"), add_special_tokens=False)["input_ids"]
    assert len(ids) < 30 and tok.decode(ids, skip_special_tokens=True) == tool_call("123*456")  # kept, unlike <|end|>
    row = {"messages": [{"role": "user", "content": "123*456"}, {"role": "assistant", "content": tool_call("123*456")},
                        {"role": "tool", "name": "calculator", "content": "56088"}, {"role": "assistant", "content": "56088"}],
           "tools": schemas()}
    ex = tokenize_sft_row(row, tok, DataConfig(paths=["x"], input_key="messages", apply_chat_template=True))
    text = tok.decode(ex.input_ids)
    assert text.startswith("<|bos|><|system|>tools: calculator(expression)<|end|><|user|>123*456<|end|><|assistant|>")
    in_loss = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m])
    assert in_loss == tool_call("123*456") + "<|end|>" + "56088<|end|>"  # both assistant turns; not the tool's answer


def test_the_calculator_and_the_reward_on_the_last_answer():
    calculator = load_callable("recipes/tools/calculator.py:calculator", "calculator", "tool", "(expression)")
    assert calculator("123*456") == "56088" and calculator(" -2+3*4 ") == "10"
    with pytest.raises(ValueError, match="not an integer expression"):
        calculator("__import__('os')")
    reward = load_callable("recipes/rewards/tool_arithmetic.py", "reward_func", "reward", "(q, p, l)")
    prompt = "<|bos|><|user|>123*456<|end|><|assistant|>"
    episodes = [tool_call("123*456") + "<|end|><|tool|>56088<|end|><|assistant|>56088<|end|>",  # right
                tool_call("123*456") + "<|end|><|tool|>56088<|end|><|assistant|><|end|>",  # no answer: the tool's is not his
                "56088<|end|>", "56000<|end|>"]
    out = reward([prompt + e for e in episodes], [prompt] * 4, ["56088"] * 4)
    assert out["rewards"] == [1.0, 0.0, 1.0, 0.0] and out["extra_logs"]["called_tool"] == [1.0, 1.0, 0.0, 0.0]
