"""The rollout engine: ``vllm.LLM`` with a weight-update extension, token ids in and out.

Weights travel as safetensors bytes and are loaded with the worker's ``reload_weights`` (the path
that works on the CPU build too, where ``model.load_weights`` after load and in-place parameter
edits silently change nothing). Every update can be verified: ``sequence_logprobs`` on a fixed
probe is compared with the learner's log-probs on the same ids (``RLLoop.verify`` in ``stages.rl.driver``).
"""

from __future__ import annotations

from stages.common.generation import Completion, generate, make_llm, sequence_logprobs


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``collective_rpc``."""

    def load_safetensors_bytes(self, data: bytes) -> int:
        from safetensors.torch import load

        weights = load(data)
        self.reload_weights(weights_iterator=list(weights.items()), is_checkpoint_format=True)
        return len(weights)


EXTENSION = f"{__name__}.WeightSyncExtension"


class RolloutEngine:
    """One vLLM engine (run as a Ray actor by the RL driver, or in-process in tests)."""

    def __init__(self, model_path: str, seed: int = 0, dtype: str = "bfloat16", max_model_len: int = 512):
        # sampled tokens' log-probs after temperature: the distribution the learners train on
        self.llm = make_llm(model_path, seed=seed, dtype=dtype, max_model_len=max_model_len, worker_extension_cls=EXTENSION,
                            logprobs_mode="processed_logprobs")

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 logprobs: bool = False) -> list[list[Completion]]:
        """``logprobs``: also the sampled tokens' log-probs (they cost ~20% of a tiny model's generation time on CPU)."""
        return generate(self.llm, prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=logprobs)

    def update_weights(self, data: bytes) -> int:
        loaded = self.llm.collective_rpc("load_safetensors_bytes", args=(data,))
        self.llm.reset_prefix_cache()
        return loaded[0]

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return sequence_logprobs(self.llm, sequences)

    def ready(self) -> bool:
        return True
