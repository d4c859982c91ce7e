"""The rollout engines: ``vllm.LLM`` with a weight-update extension, token ids in and out (:class:`RolloutEngine`,
one Ray actor each), and :class:`EnginePool`, the driver's view of them as one.

Weights reach the workers two ways (``sync.transport``, ``stages.rl.weight_sync``): broadcast over a process
group that every worker joins (:meth:`WeightSyncExtension.join_weight_group`, then ``receive_weights`` per push),
or as safetensors bytes through Ray's object store. Both load with the worker's ``reload_weights`` (the path
that works on the CPU build too, where ``model.load_weights`` after load and in-place parameter edits silently
change nothing). Every update can be verified: ``sequence_logprobs`` on a fixed probe is compared with the
learner's log-probs on the same ids.
"""

from __future__ import annotations

import os

from stages.common.generation import Completion, generate, make_llm, sequence_logprobs


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``collective_rpc`` on every
    worker of the engine (its tensor-parallel ranks)."""

    def load_safetensors_bytes(self, data: bytes) -> int:
        from safetensors.torch import load

        weights = load(data)
        self.reload_weights(weights_iterator=list(weights.items()), is_checkpoint_format=True)
        return len(weights)

    def join_weight_group(self, host: str, port: int, offset: int, world_size: int, backend: str, timeout_s: float,
                          local_host: str) -> int:
        """Join the weight-sync group as rank ``offset`` + this worker's tensor-parallel rank; that rank."""
        from stages.rl.broadcast import open_group

        rank = offset + self.rank
        self.weight_group, self.weight_backend = open_group(host, port, rank, world_size, backend, timeout_s, local_host), backend
        return rank

    def receive_weights(self, meta: list, bucket_bytes: int, fault: int | None = None) -> int:
        """Load the tensors rank 0 broadcasts, as they arrive (``meta``: their names, shapes and dtypes in order, in
        buckets of ``bucket_bytes``); ``fault`` (test hook): the process dies after that many tensors."""
        from stages.rl.broadcast import receive, sync_device

        weights = receive(self.weight_group, meta, sync_device(self.weight_backend), bucket_bytes)
        if fault is not None:
            weights = _dies_after(weights, fault)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(meta)


def _dies_after(weights, n: int):
    for i, item in enumerate(weights):
        if i == n:
            os._exit(7)
        yield item


EXTENSION = f"{__name__}.WeightSyncExtension"


def engine_settings(cfg, colocated: bool) -> dict:
    """What an RL config asks of each engine (``stages.common.generation.engine_args``' keywords but the model,
    the seed and the device)."""
    ro = cfg.rollout
    return dict(dtype=ro.dtype, max_model_len=ro.max_model_len, tensor_parallel_size=ro.tensor_parallel_size,
                max_images=cfg.data.max_images_per_prompt if cfg.data.image_key else None,
                enforce_eager=ro.enforce_eager, gpu_memory_utilization=ro.gpu_memory_utilization, colocated=colocated,
                enable_sleep=ro.enable_sleep, worker_extension_cls=EXTENSION,
                # sampled tokens' log-probs after temperature: the distribution the learners train on
                logprobs_mode="processed_logprobs")


def engine_settings_of(dtype: str = "float32", max_model_len: int = 512) -> dict:
    """An engine's settings outside an RL run (tests, benches): this machine's device, the weight-sync extension."""
    return dict(dtype=dtype, max_model_len=max_model_len, worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs")


class RolloutEngine:
    """One vLLM engine (run as a Ray actor by the RL driver, or in-process in tests); ``index``: its place among
    the run's engines; ``settings``: :func:`engine_settings`."""

    def __init__(self, model_path: str, index: int = 0, seed: int = 0, settings: dict | None = None):
        from stages.common.vision import is_vision

        self.index, self.model_path, self._episodes = index, model_path, None
        self.llm = make_llm(model_path, seed=seed, **(settings or {"worker_extension_cls": EXTENSION,
                                                                   "logprobs_mode": "processed_logprobs"}))
        self.banned = None  # a vision-language model's image tokens: never sampled
        if is_vision(model_path):
            from transformers import AutoTokenizer

            from stages.common.vision import vision_token_ids

            self.banned = vision_token_ids(AutoTokenizer.from_pretrained(model_path))

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 logprobs: bool = False, images: list[list[str]] | None = None) -> list[list[Completion]]:
        """``logprobs``: also the sampled tokens' log-probs (they cost ~20% of a tiny model's generation time on CPU);
        ``images``: each prompt's (a vision-language model's; the completions' prompt ids are then vLLM's expansion)."""
        return generate(self.llm, prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=logprobs,
                        images=images, banned=self.banned)

    def _reset_caches(self) -> None:
        """After new weights: the prefix cache, and a vision-language model's encoder cache (else the next request
        with an image seen before fails with an encoder cache miss)."""
        self.llm.reset_prefix_cache()
        if self.banned is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def run_episodes(self, jobs: list, spec) -> list:
        """Agent episodes, every one in flight at once (``stages.common.episodes``): :class:`stages.common.agents.Episode` s
        in the order of ``jobs``."""
        return self.episode_runner().run(jobs, spec)

    def episode_runner(self):
        """The engine's :class:`stages.common.episodes.EpisodeRunner` (made once: it keeps the loaded agent files)."""
        if self._episodes is None:
            from transformers import AutoTokenizer

            from stages.common.episodes import EpisodeRunner

            self._episodes = EpisodeRunner(self.llm, AutoTokenizer.from_pretrained(self.model_path),
                                           self.model_path if self.banned is not None else None, self.banned)
        return self._episodes

    def update_weights(self, data: bytes) -> int:
        loaded = self.llm.collective_rpc("load_safetensors_bytes", args=(data,))
        self._reset_caches()
        return loaded[0]

    def join_weight_group(self, host: str, port: int, offset: int, world_size: int, backend: str, timeout_s: float) -> list[int]:
        """Every worker joins the weight-sync group (their sockets on this node's address); their ranks."""
        from stages.common.cluster import node_of_actor

        local = node_of_actor()[1]
        return self.llm.collective_rpc("join_weight_group", args=(host, port, offset, world_size, backend, timeout_s, local))

    def receive_weights(self, meta: list, bucket_bytes: int) -> int:
        """One broadcast push: every worker loads the tensors as they arrive."""
        from stages.common.trainer import injected_step

        fault = injected_step("RLHF_FAULT_ENGINE_DIES", self.index)  # test hook: this engine dies mid-push
        loaded = self.llm.collective_rpc("receive_weights", args=(meta, bucket_bytes, fault))
        self._reset_caches()
        return loaded[0]

    def sleep(self) -> bool:
        """Free the engine's GPU memory (vLLM sleep mode level 2: the weights too; the next push reloads them)."""
        self.llm.sleep(level=2)
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.llm.wake_up(tags=tags)
        return True

    def sequence_logprobs(self, sequences: list[list[int]], images: list[list[str]] | None = None) -> list[list[float]]:
        return sequence_logprobs(self.llm, sequences, images)

    def node(self) -> tuple[str, str]:
        from stages.common.cluster import node_of_actor

        return node_of_actor()

    def ready(self) -> bool:
        return True


class EnginePool:
    """The engines as one: each call's prompts split round-robin over the engines, the answers put back in order.
    An engine runs its calls in order, so a weight push sent after a generation waits for it."""

    def __init__(self, engines: list, call, max_new_tokens: int, sleeps: bool = False):
        self.engines, self.call, self.max_new_tokens = engines, call, max_new_tokens  # call: Deadlines.call
        self.sleeps, self.asleep = sleeps, set()  # rollout.enable_sleep; what is asleep: "weights", "kv_cache"

    def launch(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False,
               images: list[list[str]] | None = None) -> list:
        """Start generating ``n`` samples per prompt on every engine; :meth:`gather` waits."""
        k = len(self.engines)
        return [e.generate.remote(prompt_ids[i::k], n=n, max_new_tokens=self.max_new_tokens, temperature=temperature,
                                  seed=seed + i * 1_000_003, logprobs=logprobs, images=images[i::k] if images is not None else None)
                for i, e in enumerate(self.engines)]

    def gather(self, refs: list) -> list[list[Completion]]:
        outs = self.call(refs, "engine.generate")
        result: list = [None] * sum(len(o) for o in outs)
        for i, out in enumerate(outs):
            result[i :: len(self.engines)] = out
        return result

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False):
        return self.gather(self.launch(prompt_ids, n, temperature, seed, logprobs))

    def launch_episodes(self, groups: list[list], spec) -> list:
        """Start agent episodes: ``groups`` of jobs (a prompt's ``n`` episodes), each group on one engine (its
        prompt's cache shared), the groups round-robin over the engines; :meth:`gather_episodes` waits."""
        k = len(self.engines)
        return [e.run_episodes.remote([j for g in groups[i::k] for j in g], spec) for i, e in enumerate(self.engines)]

    def gather_episodes(self, refs: list, groups: list[list]) -> list[list]:
        """The episodes of :meth:`launch_episodes`, as the groups they were given in."""
        outs, k = self.call(refs, "engine.run_episodes"), len(self.engines)
        result: list = [None] * len(groups)
        for i, out in enumerate(outs):
            it = iter(out)
            for g in range(i, len(groups), k):
                result[g] = [next(it) for _ in groups[g]]
        return result

    def push(self, data) -> None:
        """Load new weights (safetensors bytes, or an object-store reference to them) on every engine."""
        self.call([e.update_weights.remote(data) for e in self.engines], "engine.update_weights")

    def join(self, master: tuple[str, int], tp: int, world_size: int, backend: str, timeout_s: float) -> list:
        """Every engine's workers start joining the weight-sync group (engine ``i``'s from rank ``1 + i * tp``)."""
        return [e.join_weight_group.remote(*master, 1 + i * tp, world_size, backend, timeout_s) for i, e in enumerate(self.engines)]

    def receive(self, meta: list, bucket_bytes: int) -> list:
        """Every engine starts receiving one broadcast push."""
        return [e.receive_weights.remote(meta, bucket_bytes) for e in self.engines]

    def sleep(self) -> None:
        """``rollout.enable_sleep``: every engine frees its GPU memory (weights and KV cache) until woken."""
        if self.sleeps and not self.asleep:
            self.call([e.sleep.remote() for e in self.engines], "engine.sleep")
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> None:
        """Give back what ``tags`` name of the sleeping engines' memory ("weights" before a push, "kv_cache" after)."""
        tags = [t for t in tags if t in self.asleep]
        if tags:
            self.call([e.wake_up.remote(tags) for e in self.engines], "engine.wake_up")
            self.asleep -= set(tags)

    def sequence_logprobs(self, sequences: list[list[int]], images: list[list[str]] | None = None) -> list[list[list[float]]]:
        """Every engine's prompt log-probs of ``sequences`` (one list per engine; ``images``: each sequence's)."""
        return self.call([e.sequence_logprobs.remote(sequences, images) for e in self.engines], "engine.sequence_logprobs")
