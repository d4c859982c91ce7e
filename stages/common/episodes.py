"""Agent episodes in flight at once, inside a rollout engine's process (as OpenRLHF runs its agent executors).

Every episode is its own coroutine on one event loop. An action is its own vLLM request: :class:`RequestQueue`
adds it to the engine (vLLM's per-request ``LLMEngine.add_request``) and one stepping loop runs the engine in a
worker thread while requests are open, so the engine batches whatever actions are pending (continuous batching
across episodes) and an episode waiting on its environment holds no other. Environment calls (reset, step,
tools) are awaited with ``rollout.env_timeout_s`` each; sync ones run in a thread pool of
``rollout.max_concurrent_episodes`` threads, which also bounds how many episodes run at once.

Results are deterministic for a given seed whatever order episodes finish in: each action samples with a seed
of its own, hashed from (the episode's seed, its action number), and the episodes come back in job order.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass
from typing import Any

from stages.common.agents import AgentError, EpisodeSettings, episode_of
from stages.common.generation import request_seed


@dataclass
class Job:
    """One episode to run: its data row (``row``: the row's number in the data, for messages), its prompt as the
    model sees it (rendered) and as the row has it, its label and its seed."""

    row: int
    prompt: str
    raw_prompt: Any
    label: Any
    seed: int
    images: list[str] | None = None  # a vision-language model's prompt images (one image token each in prompt)


def episode_jobs(rows: list[dict], numbers: list[int], data, n: int, seed: int, render,
                 images: list[list[str]] | None = None) -> list[list[Job]]:
    """``n`` jobs per row (a group), each episode with its own seed hashed from ``seed`` and its place in the batch;
    ``numbers``: the rows' 0-based places in their data (for messages); ``render(row's prompt, its images)``: the
    prompt as the model sees it; ``images``: a vision-language model's, each row's image references."""
    from stages.common.generation import request_seed

    pics = images if images is not None else [None] * len(rows)
    return [[Job(i + 1, render(row[data.prompt_key], refs), row[data.prompt_key], row.get(data.label_key),
                 request_seed(seed, g * n + j), refs) for j in range(n)]
            for g, (i, row, refs) in enumerate(zip(numbers, rows, pics, strict=True))]


@dataclass
class Spec:
    """What every episode of a call shares: the agent and tools (files loaded in the engine's process), the
    sampling, the bounds."""

    agent: str | None
    tools: str | None
    tool_parser: str
    max_tool_calls: int
    max_turns: int
    max_new_tokens: int
    max_model_len: int
    temperature: float
    logprobs: bool
    env_timeout_s: float | None
    max_concurrent: int
    data: Any  # the DataConfig the prompts are rendered with (an agent's own first observation too)


class RequestQueue:
    """vLLM's per-request API as awaitables: :meth:`generate` queues a request, :meth:`drive` adds the queued
    requests between engine steps and resolves each when it finishes."""

    def __init__(self, llm):
        self.core = llm.llm_engine
        self.queued: list[tuple[str, Any, Any, asyncio.Future]] = []
        self.open: dict[str, asyncio.Future] = {}
        self.ids = itertools.count()
        self.wake = asyncio.Event()
        self.stepper = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.steps = 0

    async def generate(self, prompt_token_ids: list[int], params, multi_modal_data: dict | None = None) -> Any:
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if getattr(params, "n", 1) != 1:
            raise AgentError(f"an episode's action samples one sequence (sampling_params.n={params.n})")
        params = copy(params)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        fut = asyncio.get_running_loop().create_future()
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        self.queued.append((f"episode-{next(self.ids)}", prompt, params, fut))
        self.wake.set()
        return await fut

    async def drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.queued and not self.open:
                    self.wake.clear()
                    await self.wake.wait()
                for rid, prompt, params, fut in self.queued:
                    self.core.add_request(rid, prompt, params)
                    self.open[rid] = fut
                self.queued.clear()
                outs = await loop.run_in_executor(self.stepper, self.core.step)
                self.steps += 1
                for o in outs:
                    if o.finished and o.request_id in self.open:
                        self.open.pop(o.request_id).set_result(o)
        except BaseException as e:
            for fut in [*self.open.values(), *(q[3] for q in self.queued)]:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else RuntimeError("the engine stopped"))
            raise

    def close(self) -> None:
        if self.open:
            self.core.abort_request(list(self.open))
        self.stepper.shutdown(wait=True)


class EpisodeEngine:
    """The ``llm_engine`` an executor gets for one episode: ``generate(token_ids, sampling_params)`` returns a vLLM
    ``RequestOutput``; each call samples with its own seed (the episode's seed, hashed with the call's number)."""

    def __init__(self, queue: RequestQueue, job: Job, settings: EpisodeSettings, render, logprobs: bool = False,
                 allowed: list[int] | None = None):
        """``logprobs``: the run keeps the engine's log-probs, so every action asks for them (whatever sampling
        params an agent's step hands back); ``allowed``: the tokens every action samples from (a vision-language
        model's: all but its image tokens)."""
        self.queue, self.job, self.settings, self.render, self.logprobs = queue, job, settings, render, logprobs
        self.raw_prompt, self.calls, self.allowed = job.raw_prompt, 0, allowed
        self.seen: list[int] | None = None  # the last action's prompt as vLLM saw it (images expanded)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """An action: vLLM's ``RequestOutput`` for ``prompt_token_ids`` (with a vision-language model's images as
        ``multi_modal_data={"image": [...]}``, one image token each in the ids)."""
        params = copy(sampling_params)
        params.seed = request_seed(self.job.seed, self.calls)
        if self.logprobs and params.logprobs is None:
            params.logprobs = 0
        if self.allowed is not None:
            params.allowed_token_ids = self.allowed
        self.calls += 1
        out = await self.queue.generate(list(prompt_token_ids), params, multi_modal_data)
        self.seen = list(out.prompt_token_ids)
        return out


class EpisodeRunner:
    """Runs a call's episodes in one engine's process (:meth:`run`); the agent and tools are loaded once."""

    def __init__(self, llm, tokenizer, vision: str | None = None, banned: list[int] | None = None):
        """``vision``: a vision-language policy's folder (its processor); ``banned``: the tokens never sampled."""
        from stages.common.generation import allowed_tokens

        self.llm, self.tok, self.vision, self.allowed = llm, tokenizer, vision, allowed_tokens(llm, banned)
        self._loaded: dict[tuple, Any] = {}
        self.last_steps = 0  # the engine steps the last call took

    def _load(self, spec: Spec):
        from stages.common.agents import load_agent
        from stages.common.tools import PARSERS, load_tools

        key = (spec.agent, spec.tools)
        if key not in self._loaded:
            agent = load_agent(spec.agent) if spec.agent else None
            tools = load_tools(spec.tools) if spec.tools else None
            self._loaded[key] = (agent, tools)
        agent, tools = self._loaded[key]
        return agent, tools, PARSERS[spec.tool_parser]

    def run(self, jobs: list[Job], spec: Spec) -> list:
        """The episodes of ``jobs``, in order (:class:`stages.common.agents.Episode`); the first failure stops them all."""
        return asyncio.run(self._run(jobs, spec))

    async def _run(self, jobs: list[Job], spec: Spec) -> list:
        from vllm import SamplingParams

        from datasets_prep.sft import render_prompt
        from stages.common.agents import run_episode

        agent, tools, parser = self._load(spec)
        queue = RequestQueue(self.llm)
        pool = ThreadPoolExecutor(spec.max_concurrent, thread_name_prefix="environment")
        gate = asyncio.Semaphore(spec.max_concurrent)
        params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_new_tokens,
                                logprobs=0 if spec.logprobs else None)
        render = lambda p: render_prompt(self.tok, p, spec.data)  # noqa: E731
        max_images = spec.data.max_images_per_prompt
        name = f"rollout.agent {spec.agent}" if spec.agent else f"rollout.tools {spec.tools}"

        async def one(job: Job):
            async with gate:
                where = f"{name}: row {job.row}"
                settings = EpisodeSettings(spec.max_turns, spec.max_new_tokens, spec.env_timeout_s, tools, parser,
                                           spec.max_tool_calls, pool, where, self.vision, max_images)
                engine = EpisodeEngine(queue, job, settings, render, spec.logprobs, self.allowed)
                pictures = {"images": job.images} if job.images else {}  # OpenRLHF's execute(..., images=)
                if agent is None:
                    result = await run_episode(None, job.prompt, job.label, params, spec.max_model_len, self.tok, engine,
                                               job.images)
                else:
                    executor = agent.executor()
                    try:
                        result = await executor.execute(job.prompt, job.label, copy(params), spec.max_model_len, self.tok,
                                                        engine, **pictures)
                    except AgentError:
                        raise
                    except Exception as e:
                        raise AgentError(f"{where}: the agent raised {type(e).__name__}: {e}") from e
                if self.vision is not None and isinstance(result, dict) and "images" not in result:
                    result = {**result, "images": job.images}
                return episode_of(result, self.tok, spec.logprobs, where, self.vision, engine.seen)

        driver = asyncio.create_task(queue.drive())
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(j)) for j in jobs]
                waiting = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
                done, _ = await asyncio.wait([waiting, driver], return_when=asyncio.FIRST_COMPLETED)
                if driver in done:  # the engine failed: every episode waits on it
                    driver.result()
            return [t.result() for t in tasks]
        except BaseExceptionGroup as eg:
            raise _first(eg) from None
        finally:
            driver.cancel()
            await asyncio.gather(driver, return_exceptions=True)
            self.last_steps = queue.steps
            queue.close()
            pool.shutdown(wait=False, cancel_futures=True)


def _first(eg: BaseExceptionGroup) -> BaseException:
    """The first error of a failed group of episodes (the one that stopped the others)."""
    e: BaseException = eg
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def episodes_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target (tests, ``bench/agents.py``): one engine on ``job["model"]`` runs each of ``job["runs"]``
    (``{"jobs": [Job fields], "spec": Spec fields}``); per run its episodes (as dicts) and seconds."""
    import time
    from dataclasses import asdict

    from datasets_prep.loading import DataConfig
    from stages.rl.rollout import RolloutEngine, engine_settings_of

    engine = RolloutEngine(job["model"], seed=job.get("seed", 0),
                           settings=engine_settings_of(job.get("dtype", "float32"), job.get("max_model_len", 512)))
    runner = engine.episode_runner()
    out = []
    for run in job["runs"]:
        spec = Spec(**{**run["spec"], "data": DataConfig.model_validate(run["spec"]["data"])})
        t = time.perf_counter()
        episodes = runner.run([Job(**j) for j in run["jobs"]], spec)
        out.append({"seconds": time.perf_counter() - t, "engine_steps": runner.last_steps,
                    "episodes": [asdict(e) for e in episodes]})
    return {"runs": out}
