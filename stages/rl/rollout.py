"""The rollout engines: ``vllm.LLM`` with a weight-update extension, token ids in and out (:class:`RolloutEngine`,
one Ray actor each), and :class:`EnginePool`, the driver's view of them as one.

Weights travel as safetensors bytes and are loaded with the worker's ``reload_weights`` (the path
that works on the CPU build too, where ``model.load_weights`` after load and in-place parameter
edits silently change nothing). Every update can be verified: ``sequence_logprobs`` on a fixed
probe is compared with the learner's log-probs on the same ids (``stages.rl.weight_sync``).
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

    def node(self) -> tuple[str, str]:
        from stages.common.cluster import node_of_actor

        return node_of_actor()

    def ready(self) -> bool:
        return True


class EnginePool:
    """The engines as one: each call's prompts split round-robin over the engines, the answers put back in order.
    An engine runs its calls in order, so a weight push sent after a generation waits for it."""

    def __init__(self, engines: list, call, max_new_tokens: int):
        self.engines, self.call, self.max_new_tokens = engines, call, max_new_tokens  # call: Deadlines.call

    def launch(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False) -> list:
        """Start generating ``n`` samples per prompt on every engine; :meth:`gather` waits."""
        k = len(self.engines)
        return [e.generate.remote(prompt_ids[i::k], n=n, max_new_tokens=self.max_new_tokens, temperature=temperature,
                                  seed=seed + i * 1_000_003, logprobs=logprobs)
                for i, e in enumerate(self.engines)]

    def gather(self, refs: list) -> list[list[Completion]]:
        outs = self.call(refs, "engine.generate")
        result: list = [None] * sum(len(o) for o in outs)
        for i, out in enumerate(outs):
            result[i :: len(self.engines)] = out
        return result

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False):
        return self.gather(self.launch(prompt_ids, n, temperature, seed, logprobs))

    def push(self, data) -> None:
        """Load new weights (safetensors bytes, or an object-store reference to them) on every engine."""
        self.call([e.update_weights.remote(data) for e in self.engines], "engine.update_weights")

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Every engine's prompt log-probs of ``sequences`` (one list per engine)."""
        return self.call([e.sequence_logprobs.remote(sequences) for e in self.engines], "engine.sequence_logprobs")
