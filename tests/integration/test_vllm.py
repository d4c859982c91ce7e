"""vLLM (the CPU build here) loads the stages' checkpoints and agrees with transformers on them."""


import pytest
import torch

from stages.common.launcher import launch
from stages.common.logprobs import token_logps
from stages.eval import EvalConfig, run_eval

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(micro_sft):
    return micro_sft


def test_vllm_logprobs_match_transformers_on_the_sft_output(trained, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True)["input_ids"]
               for p in ("3+4", "12+9", "50+50")]
    out = launch("stages.common.generation:probe_rank", {"model": trained.path, "prompts": prompts, "dtype": "float32"}, 1, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(trained.path, dtype=torch.float32).eval()
    for seq, vllm_lps, comp, comp_lps in zip(out["sequences"], out["sequence_logprobs"], out["completions"], out["completion_logprobs"]):
        with torch.no_grad():
            hf = token_logps(model(input_ids=torch.tensor([seq])).logits, torch.tensor([seq]))[0, 1:]
        assert torch.allclose(hf, torch.tensor(vllm_lps), atol=2e-3), (hf, vllm_lps)
        # the sampled tokens' log-probs from generation agree with the scoring pass
        assert torch.allclose(torch.tensor(comp_lps), hf[-len(comp):], atol=2e-3)
        # greedy: each generated token is the transformers argmax at its position
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0]
        start = len(seq) - len(comp)
        assert logits[start - 1 : len(seq) - 1].argmax(-1).tolist() == comp


def test_eval_stage_report(trained, micro_model, task_files, tmp_path):
    """Greedy accuracy, pass@k, length, KL to the reference (zero against itself, positive against the
    random base), and the report files (markdown table + PNG)."""
    from pathlib import Path

    cfg = EvalConfig.model_validate({
        "data": {"paths": [str(task_files["eval"])], "prompt_key": "prompt", "label_key": "answer"},
        "max_new_tokens": 8, "num_samples": 4, "pass_k": 2, "output_root": str(tmp_path),
    })
    report = run_eval(cfg, {"base": micro_model, "sft": trained}, reference=trained)
    base, sft = report.metrics["base"], report.metrics["sft"]
    assert base["n"] == sft["n"] == 32
    assert base["accuracy"] == 0.0 and base["pass@k"] < 0.1  # random init (a sampled digit can hit a 1-digit sum)
    assert 0.0 <= sft["accuracy"] <= 1.0 and 0.0 <= sft["pass@k"] <= 1.0
    assert sft["response_length"] < 6.0  # the SFT model learned to end its turn after a short answer
    assert abs(sft["kl_to_reference"]) < 1e-4  # the reference is the model itself
    assert base["kl_to_reference"] > 1.0  # the random model's samples are unlikely under the SFT model
    assert sft["reward"] is None
    md = Path(report.markdown).read_text()
    assert "| base | 0.0% |" in md and "| sft |" in md and "kl_to_reference" in md
    assert Path(report.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def seeded_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: the same seeded sampling three times (seeds 3, 3, 4) in one engine."""
    from stages.common.generation import generate, make_llm

    llm = make_llm(job["model"], dtype="float32")
    runs = [[[c.token_ids for c in g] for g in generate(llm, job["prompts"], max_new_tokens=4, temperature=1.0, n=2, seed=s)]
            for s in (3, 3, 4)]
    return {"runs": runs, "budget": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens}


def test_seeded_sampling_of_more_prompt_tokens_than_one_engine_step_takes(micro_model, tmp_path):
    """Prompts whose tokens exceed one engine step's budget: vLLM's CPU runner used to fail on the seeded
    request whose prefill was split across two steps ("CPU Generator does not use offset"); each prompt is
    now prefilled whole, and the samples reproduce with their seed (the second call also hits the prefix cache)."""
    prompts = [[5 + (i + j) % 20 for j in range(120)] for i in range(48)]
    out = launch("tests.integration.test_vllm:seeded_rank", {"model": micro_model.path, "prompts": prompts}, 1, tmp_path)
    assert sum(map(len, prompts)) * 2 > out["budget"]  # 48 prompts x 2 samples x 120 tokens: more than one step
    first, again, other = out["runs"]
    assert first == again and first != other
    assert all(len(g) == 2 and all(1 <= len(t) <= 4 for t in g) for g in first)
