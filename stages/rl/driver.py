"""The RL stage: its own Ray cluster, vLLM rollout engines, DeepSpeed ZeRO-3 learners, verified sync.

The loop, top to bottom, once per step:
sample prompts -> generate ``n_samples_per_prompt`` responses in vLLM (token ids) -> rewards ->
policy (old) and reference log-probs on the learners -> advantages (``algorithms``) -> PPO/GSPO
updates for ``ppo_epochs`` -> push the weights to every engine -> verify on a probe -> metrics.

Token-in-token-out: the learners train on exactly the token ids vLLM produced.

Run: ``python -m stages.rl recipes/rl/tiny.yaml base=runs/sft-<key>/checkpoint``
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from checkpoints import CheckpointRef, commit, require_kind, staging, verify
from checkpoints.state import commit_state, read_json_state, resumable_state, tag_of
from datasets_prep.loading import check_prompt_label_row, load_rows
from datasets_prep.packing import BatchSchedule
from datasets_prep.sft import render_prompt
from stages.common.launcher import PROJECT_ROOT
from stages.common.logprobs import logprob_difference
from stages.common.progress import report_progress
from stages.common.reaper import start as start_reaper
from stages.common.stage import (
    ADAPTER,
    POLICY,
    REWARD,
    Input,
    StageRun,
    StageSpec,
    print_result,
    trained_output,
)
from stages.rl.config import RLConfig
from stages.rl.experience import (
    Experience,
    Forward,
    KLController,
    Samples,
    Scores,
    StepPlan,
    make_experience,
    updates_of,
)
from stages.rl.rewards import FuncReward, HttpReward, RewardError

STAGE = "rl"


class SyncError(RuntimeError):
    """vLLM's log-probs after a weight push do not match the learner's."""


class CallTimeout(RuntimeError):
    """An actor gave no answer within ``ray.call_timeout_s`` (``ray.startup_timeout_s`` while starting); the
    message names it and the deadline's setting."""


def ray_get(refs, what: str, timeout_s: float, setting: str = "ray.call_timeout_s"):
    """``ray.get`` with a deadline (the config field ``setting``): ``what`` (``role.method``) and the rank of
    every call still pending are named in the error (the actors of a list are in rank order)."""
    import ray

    many = isinstance(refs, list)
    refs_list = refs if many else [refs]
    _, pending = ray.wait(refs_list, num_returns=len(refs_list), timeout=timeout_s)
    if pending:
        ranks = [i for i, r in enumerate(refs_list) if r in pending]
        role, _, method = what.partition(".")
        raise CallTimeout(f"RL stage: {role} rank(s) {ranks} of {len(refs_list)} gave no answer to {method or what} within "
                          f"{timeout_s:g} s ({setting}); stopping the stage and its Ray cluster")
    out = ray.get(refs_list)
    return out if many else out[0]


def make_reward_source(cfg: RLConfig):
    if cfg.reward.func:
        return FuncReward(cfg.reward.func)
    if cfg.reward.url:
        r = cfg.reward
        return HttpReward(r.urls, r.timeout_s, r.retries, protocol=r.protocol, token_env=r.token_env)
    raise RewardError("reward: no source given (set reward.func, reward.url or reward.model)")


def _env() -> dict[str, str]:
    keep = ("TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_CPU_KVCACHE_SPACE",
            "RLHF_FAULT_STEP", "RLHF_FAULT_RANK", "RLHF_FAULT_MODE", "RLHF_FAULT_HANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


_PRIVATE_CLUSTER_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def private_cluster_env() -> None:
    """Settings of a private cluster, before Ray starts: token authentication with a fresh token (in this
    process's environment only, inherited by Ray's processes and never written or logged), and every
    Ray server bound to 127.0.0.1 (Ray's single-machine mode: the node address is loopback, so the GCS,
    raylet, object manager, agents and workers listen there and nowhere else)."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    if "ray" in sys.modules:  # imported earlier in this process: Ray caches both settings at import
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config

        ray_constants.ENABLE_RAY_CLUSTER = False
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


RAY_TMP_PREFIX = "rlray-"


def remove_stale_cluster_folders() -> None:
    """Private clusters' temp folders (``/tmp/rlray-<pid>-*``) whose process is gone and whose reaper did not
    run (both killed at once, a reboot): removed at the next start."""
    import psutil

    for folder in Path("/tmp").glob(f"{RAY_TMP_PREFIX}*-*"):
        try:
            owner = int(folder.name[len(RAY_TMP_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not psutil.pid_exists(owner):
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def ray_cluster(cfg: RLConfig):
    """A private local Ray cluster for this task (or the one at ``ray.address``); always shut down."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    saved = {k: os.environ.get(k) for k in _PRIVATE_CLUSTER_ENV}
    if not cfg.ray.address:
        private_cluster_env()
    import ray

    tmp = None
    # SIGTERM (a killed task, a stopped worker) must unwind through the shutdown below like Ctrl-C does
    previous = None
    if threading.current_thread() is threading.main_thread():
        def _terminate(signum, frame):
            raise SystemExit(f"RL stage stopped by signal {signum}")

        previous = signal.signal(signal.SIGTERM, _terminate)
    import psutil  # a dependency of DeepSpeed and vLLM

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    reaper = None
    try:  # everything from here on, ray.init included, unwinds through the shutdown below
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, runtime_env={"env_vars": _env()}, log_to_driver=True)
        else:
            remove_stale_cluster_folders()
            # short: Ray's socket paths are length-limited; the pid says whose it is (remove_stale_cluster_folders)
            tmp = tempfile.mkdtemp(prefix=f"{RAY_TMP_PREFIX}{os.getpid()}-", dir="/tmp")
            # if this process is SIGKILLed, the reaper ends the cluster's processes and removes its folder
            reaper = start_reaper(os.getpid(), tmp)
            cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, cfg.train.world_size)
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=tmp,
                     runtime_env={"env_vars": _env()}, log_to_driver=True)
        yield tmp
    finally:
        # a local cluster's raylet, GCS and workers descend from this process; after shutdown the
        # workers exit on their own a moment later: wait for them (and end any that linger)
        skip = before | ({reaper.pid} if reaper is not None else set())  # the reaper leaves once the folder is gone
        ours = [p for p in psutil.Process().children(recursive=True) if p.pid not in skip] if tmp else []
        ray.shutdown()
        _, alive = psutil.wait_procs(ours, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if reaper is not None:  # it sees the folder gone and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(timeout=5)
        for k, v in saved.items():  # the token dies with its cluster
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_rl(config: RLConfig, policy: CheckpointRef, reward_model: CheckpointRef | None = None,
           critic: CheckpointRef | None = None, *, run: StageRun | None = None) -> CheckpointRef:
    """Train ``policy`` with RL against the configured reward source; returns the final checkpoint.

    ``critic`` (estimator ``gae`` only): the checkpoint the critic starts from; unset, the reward model
    when there is one (as OpenRLHF), else the policy."""
    from transformers import AutoTokenizer

    verify(policy)
    require_kind(policy, ("full",), "the RL policy")
    # inputs not given come from their config fields (reward.model, critic.model); the critic only with one
    inputs = SPEC.resolve_inputs(config, {"policy": policy, "reward_model": reward_model, "critic": critic})
    reward_model, critic = inputs["reward_model"], inputs["critic"]
    plan = StepPlan.of(config)
    run = SPEC.identify(config, inputs, run)
    if reward_model is not None:
        verify(reward_model)
        require_kind(reward_model, ("reward",), "the RL reward model")
        reward_fn = None
    else:
        # fails fast on a bad reward file; an agent's steps give the rewards
        reward_fn = None if config.rollout.agent else make_reward_source(config)
    if config.rollout.agent:
        from stages.rl.agents import load_agent

        load_agent(config.rollout.agent)  # a bad agent file fails here, before Ray starts
    critic_init = None
    if plan.values:
        critic_init = critic or reward_model or policy
        if critic is not None:  # the policy and the reward model are verified above
            verify(critic)
        require_kind(critic_init, ("full", "reward"), "the critic's starting model")
    tokenizer = AutoTokenizer.from_pretrained(policy.path)
    rows = load_rows(config.data, check_prompt_label_row(config.data))
    eval_rows = load_rows(config.eval_data, check_prompt_label_row(config.eval_data)) if config.eval_data else []
    if config.eval_grader:
        from stages.common.graders import load_grader

        load_grader(config.eval_grader)  # a bad reference fails here, before Ray starts
    if len(rows) < config.rollout.rollout_batch_size:
        raise ValueError(f"{', '.join(config.data.paths)}: {len(rows)} prompts, fewer than rollout_batch_size={config.rollout.rollout_batch_size}")
    with run.claimed() as run_dir, staging(run_dir / "checkpoint") as tmp, ray_cluster(config):
        dest = run_dir / "checkpoint"
        loop = RLLoop(config, policy.path, tokenizer, rows, eval_rows, reward_fn, run_dir,
                      reward_model.path if reward_model else None, critic_init.path if critic_init else None)
        summary = loop.run()
        loop.export(str(tmp))  # with LoRA: the adapter, on the policy it started from
        lora = config.lora.enabled
        return commit(tmp, dest, stage=STAGE, kind="adapter" if lora else "full", config_hash=run.key, parent=policy,
                      base=policy if lora else None, extra=summary)


def place(cfg: RLConfig, critics: int = 0):
    """A placement group for the task's actors and the options that put each actor in its bundle.

    CPU: one 1-CPU bundle per learner rank; engines, critic ranks and the reward model take no CPU
    reservation (they run while the learners wait). GPU: one GPU per learner rank and per critic rank, and
    per engine ``tensor_parallel_size`` GPUs of their own, or with ``ray.colocate_all`` shares of the
    learners' GPUs.
    """
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n, engines = cfg.train.world_size, cfg.rollout.num_engines
    gpu = torch.cuda.is_available()
    bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(n)]
    own_bundles = gpu and not cfg.ray.colocate_all
    if own_bundles:
        bundles += [{"GPU": cfg.rollout.tensor_parallel_size} for _ in range(engines)] + [{"GPU": 1} for _ in range(critics)]
    pg = placement_group(bundles, strategy="PACK")
    ray_get(pg.ready(), "placement group", cfg.ray.startup_timeout_s, "ray.startup_timeout_s")

    def at(bundle: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)}

    def learner_opts(rank: int) -> dict:
        share = 0.5 if not critics else 0.25
        return {"num_cpus": 1, "num_gpus": (share if cfg.ray.colocate_all else 1) if gpu else 0, **at(rank)}

    def engine_opts(i: int) -> dict:
        if own_bundles:
            return {"num_cpus": 0, "num_gpus": cfg.rollout.tensor_parallel_size, **at(n + i)}
        return {"num_cpus": 0, "num_gpus": (0.5 / max(1, engines // n)) if gpu else 0, **at(i % n)}

    def critic_opts(rank: int) -> dict:
        if own_bundles:
            return {"num_cpus": 0, "num_gpus": 1, **at(n + engines + rank)}
        return {"num_cpus": 0, "num_gpus": 0.25 if gpu else 0, **at(rank % n)}

    return pg, learner_opts, engine_opts, critic_opts


def _start_group(cls, n: int, opts, runtime_env: dict, config: dict, model_path: str, total_updates: int) -> tuple[list, list]:
    """``n`` ranks of ``cls`` (a Learner or Critic) as Ray actors forming one torch.distributed group: the actors
    and their pending ``setup`` calls (wait with :func:`ray_get`; other actors can start meanwhile)."""
    import ray

    actors = [ray.remote(cls).options(runtime_env=runtime_env, **opts(r)).remote(r, n) for r in range(n)]
    master = ray_get(actors[0].address.remote(), f"{cls.__name__.lower()}.address", config["ray"]["startup_timeout_s"],
                     "ray.startup_timeout_s")
    return actors, [a.setup.remote(config, model_path, total_updates, master) for a in actors]


class RLLoop:
    """The RL stage's loop over typed steps (``stages.rl.experience``): rollout -> score -> forward ->
    make_experience -> update (critic, then policy) -> sync; what a step needs is ``self.plan``."""

    def __init__(self, cfg: RLConfig, policy_path: str, tokenizer, rows, eval_rows, reward_fn, run_dir: Path,
                 reward_model_path: str | None = None, critic_path: str | None = None):
        import ray

        from stages.rl.critic import Critic
        from stages.rl.learner import Learner
        from stages.rl.rewards import RewardModelScorer
        from stages.rl.rollout import RolloutEngine

        self.cfg, self.tok, self.rows, self.eval_rows, self.reward_fn, self.run_dir = cfg, tokenizer, rows, eval_rows, reward_fn, run_dir
        self.grader = None
        if cfg.eval_grader:
            from stages.common.graders import load_grader

            self.grader = load_grader(cfg.eval_grader)
        self.policy_path = policy_path
        self.plan = StepPlan.of(cfg)
        self.agent = None
        if cfg.rollout.agent:
            from stages.rl.agents import load_agent

            self.agent = load_agent(cfg.rollout.agent)
        n = cfg.train.world_size
        ro = cfg.rollout
        updates_per_step = ro.rollout_batch_size * ro.n_samples_per_prompt // cfg.train.train_batch_size
        # Ray pins OMP_NUM_THREADS to an actor's CPU count (1 for num_cpus=0): give each its share of the
        # machine instead; learners, critic and engines take turns, so the engines may use every core
        cores = os.cpu_count() or 1
        learner_env = {"env_vars": {**_env(), "OMP_NUM_THREADS": str(max(1, cores // n))}}
        engine_env = {"env_vars": {**_env(), "OMP_NUM_THREADS": str(cores)}}
        self.pg, learner_opts, engine_opts, critic_opts = place(cfg, n if self.plan.values else 0)
        config = cfg.model_dump(mode="json")
        policy_steps = (cfg.max_steps - (cfg.critic.freezing_steps if self.plan.values else 0)) * updates_per_step * cfg.algo.ppo_epochs
        # the engines start while the learners load (their processes import vLLM and build the engine meanwhile);
        # on GPUs shared with the learners (colocate_all) after them, so vLLM sizes its cache on what they left
        def start_engines() -> list:
            return [
                ray.remote(RolloutEngine).options(runtime_env=engine_env, **engine_opts(i)).remote(
                    policy_path, seed=cfg.seed + i, dtype=ro.dtype, max_model_len=ro.max_model_len
                )
                for i in range(ro.num_engines)
            ]

        engines_wait = torch.cuda.is_available() and cfg.ray.colocate_all
        self.engines = [] if engines_wait else start_engines()
        self.learners, setups = _start_group(Learner, n, learner_opts, learner_env, config, policy_path, policy_steps)
        self.critics, critic_setups = [], []
        if self.plan.values:
            self.critics, critic_setups = _start_group(Critic, n, critic_opts, learner_env, config, critic_path,
                                                       cfg.max_steps * updates_per_step * cfg.algo.ppo_epochs)
        self.startup(setups, "learner.setup")
        self.startup(critic_setups, "critic.setup")
        if engines_wait:
            self.engines = start_engines()
        self.startup([e.ready.remote() for e in self.engines], "engine.ready")
        self.reward_actor = None
        if reward_model_path:  # the reward model is served from its own actor, sharing the CPUs like vLLM
            self.reward_actor = (
                ray.remote(num_cpus=0)(RewardModelScorer).options(runtime_env=engine_env)
                .remote(reward_model_path, cfg.algo.normalize_reward)
            )
        self.kl = KLController(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        self.prompt_ids = [self._render(r) for r in rows]
        self.schedule = BatchSchedule(len(rows), ro.rollout_batch_size, ro.rollout_batch_size, 1, cfg.seed)
        # dynamic filtering's extra prompts: a schedule of its own, so the main batches stay as without filtering
        self.extra_schedule = BatchSchedule(len(rows), ro.rollout_batch_size, ro.rollout_batch_size, 1, cfg.seed + 7_919)
        self.reward_time = 0.0  # seconds spent in the reward source during the current step

    def get(self, refs, what: str):
        return ray_get(refs, what, self.cfg.ray.call_timeout_s)

    def startup(self, refs, what: str):
        return ray_get(refs, what, self.cfg.ray.startup_timeout_s, "ray.startup_timeout_s") if refs else []

    # -- the pieces of a step, in the order the loop calls them --------------------------------------

    def _render(self, row: dict) -> list[int]:
        return self._render_prompt(row[self.cfg.data.prompt_key])

    def _render_prompt(self, prompt) -> list[int]:
        return self.tok(render_prompt(self.tok, prompt, self.cfg.data), add_special_tokens=False)["input_ids"]

    def launch(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False) -> list:
        """Start generating on every engine (a round-robin shard of the prompts each); :meth:`gather` waits.
        An engine runs its calls in order, so a weight push sent later waits for this generation."""
        shards = [prompt_ids[i :: len(self.engines)] for i in range(len(self.engines))]
        return [
            e.generate.remote(s, n=n, max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=temperature,
                              seed=seed + i * 1_000_003, logprobs=logprobs)
            for i, (e, s) in enumerate(zip(self.engines, shards))
        ]

    def gather(self, refs: list) -> list:
        outs = self.get(refs, "engine.generate")
        result: list = [None] * sum(len(o) for o in outs)
        for i, out in enumerate(outs):
            for j, group in enumerate(out):
                result[i + j * len(self.engines)] = group
        return result

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False):
        return self.gather(self.launch(prompt_ids, n, temperature, seed, logprobs))

    def batch(self, step: int, extra: int = 0) -> tuple[list[int], int]:
        """The rows of the step's prompts (``extra`` > 0: its extra batch number ``extra``, drawn for dynamic
        filtering) and their sampling seed."""
        if extra:
            idx = self.extra_schedule.global_batch(step * self.cfg.algo.dynamic_filtering_max_batches + extra - 1)
        else:
            idx = self.schedule.global_batch(step)
        return list(idx), self.cfg.seed * 100_003 + step + extra * 1_000_033

    def start_rollout(self, step: int, extra: int = 0) -> tuple[list[int], list]:
        """Start sampling the step's prompts, ``n_samples_per_prompt`` each (with vLLM's log-probs when the plan
        asks for them): the prompts' rows and the engines' pending calls."""
        ro = self.cfg.rollout
        idx, seed = self.batch(step, extra)
        refs = self.launch([self.prompt_ids[i] for i in idx], ro.n_samples_per_prompt, ro.temperature, seed,
                           logprobs=self.plan.rollout_logp)
        return idx, refs

    def rollout(self, step: int, extra: int = 0, started: tuple[list[int], list] | None = None) -> tuple[list[int], list]:
        """The step's prompts and their sampled groups (``started``: from :meth:`start_rollout`, ahead of time);
        with an agent, its episodes, turn by turn."""
        ro = self.cfg.rollout
        if self.agent is not None:
            idx, seed = self.batch(step, extra)
            return idx, self.episodes([self.rows[i] for i in idx], self.cfg.data, ro.n_samples_per_prompt, ro.temperature,
                                      seed, self.plan.rollout_logp)
        idx, refs = started or self.start_rollout(step, extra)
        return idx, self.gather(refs)

    def episodes(self, rows: list[dict], data, n: int, temperature: float, seed: int, logprobs: bool) -> list[list]:
        """The agent's episodes on ``rows`` (``data``: the config naming their prompt and label columns), ``n``
        per row, every turn's actions sampled by the engines."""
        from stages.rl.agents import run_episodes

        ro = self.cfg.rollout
        return run_episodes(self.agent, lambda ids, k, s: self.generate(ids, k, temperature, s, logprobs), self.tok,
                            self._render_prompt, rows, data.prompt_key, data.label_key, n, ro.max_turns,
                            ro.max_new_tokens, ro.max_model_len, seed, logprobs)

    def score_groups(self, samples: Samples, groups: list) -> Scores:
        """The samples' scores: the reward source's, or an agent's episodes' own (their last info as metrics)."""
        if self.agent is None:
            return self.score(samples)
        flat = [e for g in groups for e in g]
        logs = {k: torch.tensor([e.info.get(k, float("nan")) for e in flat]) for k in sorted({k for e in flat for k in e.info})}
        logs["turns"] = torch.tensor([float(e.turns) for e in flat])
        return Scores(torch.tensor([e.reward for e in flat]), torch.tensor([e.score for e in flat]), logs)

    def collect(self, step: int, started: tuple[list[int], list] | None = None) -> tuple[Samples, Scores, dict[str, float]]:
        """The step's samples and their scores. With ``algo.dynamic_filtering`` (DAPO), the groups whose mean
        score lies outside the range are dropped and extra batches of prompts drawn (at most
        ``dynamic_filtering_max_batches``) until ``rollout_batch_size`` groups remain; the first ones are kept.
        Returns the share of drawn groups filtered out (and how many were drawn) as metrics."""
        algo, ro = self.cfg.algo, self.cfg.rollout
        idx, groups = self.rollout(step, started=started)
        samples = Samples.of(idx, groups, self.tok.pad_token_id, self.plan.rollout_logp)
        scored = self.score_groups(samples, groups)
        if algo.dynamic_filtering is None:
            return samples, scored, {}
        from stages.rl.algorithms import groups_in_range

        n, want = ro.n_samples_per_prompt, ro.rollout_batch_size
        kept_idx, kept_groups, kept_scores, drawn = [], [], [], 0
        for extra in range(algo.dynamic_filtering_max_batches + 1):
            if extra:
                idx, groups = self.rollout(step, extra)
                scored = self.score_groups(Samples.of(idx, groups, self.tok.pad_token_id, self.plan.rollout_logp), groups)
            drawn += len(idx)
            keep = groups_in_range(scored.scores, n, *algo.dynamic_filtering)
            kept_idx += [idx[g] for g in keep]
            kept_groups += [groups[g] for g in keep]
            kept_scores.append(scored.rows([g * n + j for g in keep for j in range(n)]))
            if len(kept_idx) >= want:
                break
        else:
            raise RuntimeError(
                f"dynamic filtering: only {len(kept_idx)} of the {drawn} prompt groups drawn at step {step + 1} have a mean "
                f"score inside algo.dynamic_filtering={list(algo.dynamic_filtering)}, fewer than rollout_batch_size={want} "
                f"after algo.dynamic_filtering_max_batches={algo.dynamic_filtering_max_batches} extra batches; widen the "
                "range, allow more extra batches, or use data the policy neither always solves nor always fails"
            )
        samples = Samples.of(kept_idx[:want], kept_groups[:want], self.tok.pad_token_id, self.plan.rollout_logp)
        scored = Scores.cat(kept_scores).rows(list(range(want * n)))
        return samples, scored, {"filtered_share": 1 - (len(kept_idx) / drawn), "prompts_drawn": float(drawn)}

    def rewards(self, rows: list[dict], samples: Samples) -> dict[str, Any]:
        """The reward source's answer for every sample (consecutive groups, one per row, in order)."""
        if self.reward_actor is not None:

            from stages.rl.rewards import check_result

            seqs = [p + r for p, r in zip(samples.prompt_ids, samples.response_ids, strict=True)]
            return check_result({"rewards": self.get(self.reward_actor.score.remote(seqs), "reward model.score")}, len(seqs), "reward model")
        per = len(samples.prompt_ids) // len(rows)
        queries, prompts, labels = [], [], []
        for k, (p, r) in enumerate(zip(samples.prompt_ids, samples.response_ids, strict=True)):
            if k % per == 0:  # a group's samples share their prompt
                prompt_text = self.tok.decode(p)
            queries.append(prompt_text + self.tok.decode(r, skip_special_tokens=True))
            prompts.append(prompt_text)
            labels.append(rows[k // per][self.cfg.data.label_key])
        return self.reward_fn(queries, prompts, labels)

    def score(self, samples: Samples) -> Scores:
        t = time.perf_counter()
        try:
            return Scores.of(self.rewards([self.rows[i] for i in samples.prompt_index], samples))
        finally:
            self.reward_time += time.perf_counter() - t

    def _shards(self, batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
        size = batch["input_ids"].shape[0] // n
        return [{k: v[r * size : (r + 1) * size] for k, v in batch.items()} for r in range(n)]

    def forward(self, samples: Samples) -> Forward:
        """The no-grad passes the plan asks for: old and reference log-probs (learners), values (critic)."""

        plan, batch = self.plan, samples.tensors()
        logps = [lr.logprobs.remote(s, policy=plan.old_logp, reference=plan.ref_logp)
                 for lr, s in zip(self.learners, self._shards(batch, len(self.learners)))] if plan.old_logp or plan.ref_logp else []
        values = [c.values.remote(s) for c, s in zip(self.critics, self._shards(batch, len(self.critics)))] if plan.values else []
        outs = self.get(logps, "learner.logprobs")
        cat = {k: torch.cat([o[k] for o in outs]) for k in (outs[0] if outs else {})}
        return Forward(cat.get("logp"), cat.get("ref_logp"), torch.cat(self.get(values, "critic.values")) if values else None)

    @staticmethod
    def rollout_logprob_diff(samples: Samples, old_logp: torch.Tensor) -> float:
        """Mean |vLLM's sampling log-prob - the learners' old log-prob| over every response token of the step:
        the engines and the learners hold the same weights, so this stays at rounding level unless a sync
        went wrong (a whole-batch check beside the probe's)."""
        keep = samples.response_mask.bool()
        return (samples.rollout_logp[keep] - old_logp[keep]).abs().mean().item() if keep.any() else 0.0

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of critic updates, then of policy updates (none while the critic warms up)."""

        cfg = self.cfg
        out: dict[str, float] = {}
        tokens = max(float(exp.samples.response_mask.sum()), 1.0)
        epochs = cfg.algo.ppo_epochs
        if self.critics:
            shares = updates_of(exp, cfg, len(self.critics))
            sums = _sum_dicts(self.get([c.train.remote(u) for c, u in zip(self.critics, shares)], "critic.train") for _ in range(epochs))
            out.update(critic_loss=sums["critic_loss"] / (tokens * epochs), value_mean=sums["values"] / (tokens * epochs),
                       critic_clip_ratio=sums["critic_clip_ratio"] / (tokens * epochs),
                       critic_grad_norm=sums["critic_grad_norm"] / (len(self.critics) * epochs),
                       critic_lr=sums["critic_lr"] / (len(self.critics) * epochs))
            out["return_mean"] = float(exp.returns[exp.samples.response_mask.bool()].mean())
        if self.policy_frozen(step):
            out["policy_frozen"] = 1.0
            return out
        shares = updates_of(exp, cfg, len(self.learners))
        sums = _sum_dicts(self.get([lr.train.remote(u, self.kl.value) for lr, u in zip(self.learners, shares)], "learner.train") for _ in range(epochs))
        n = len(self.learners)
        out.update(kl_sum=sums["kl"] / epochs, policy_loss=sums["policy_loss"] / (tokens * epochs),
                   clip_ratio=sums["clip_ratio"] / (tokens * epochs), entropy=sums["entropy"] / (tokens * epochs),
                   grad_norm=sums["grad_norm"] / (n * epochs), lr=sums["lr"] / (n * epochs))
        if "vllm_kl" in sums:
            out["vllm_kl"] = sums["vllm_kl"] / (tokens * epochs)
        return out

    def policy_frozen(self, step: int) -> bool:
        """The first ``critic.freezing_steps`` steps train the critic only (OpenRLHF's freezing_actor_steps)."""
        return bool(self.critics) and step < self.cfg.critic.freezing_steps

    def sync(self, probe: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Push the learners' weights to every engine; return the probe's mean and max |log-prob difference|."""
        import ray

        data = self.get([lr.weights_bytes.remote(self.cfg.rollout.dtype) for lr in self.learners], "learner.weights_bytes")[0]
        if os.environ.get("RLHF_FAULT_SKIP_PUSH") != "1":  # test hook: a push that silently does nothing
            ref = ray.put(data)
            self.get([e.update_weights.remote(ref) for e in self.engines], "engine.update_weights")
        return self.verify(probe) if self.cfg.verify_sync else (float("nan"), float("nan"))

    def verify(self, probe: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Mean and max |log-prob difference| between every engine and the learners on the probe.

        The check is on the mean over the probe's tokens: bf16 rounding moves single unlikely tokens by
        more than a real update does, while a stale or half-loaded engine shifts them all."""

        learner = self.get([lr.probe_logprobs.remote(probe) for lr in self.learners], "learner.probe_logprobs")[0]
        seqs = [row[row_mask.bool()].tolist() for row, row_mask in zip(probe["input_ids"], probe["attention_mask"])]
        engine_lps = self.get([e.sequence_logprobs.remote(seqs) for e in self.engines], "engine.sequence_logprobs")
        mean, worst = 0.0, 0.0
        for lps in engine_lps:
            ours = torch.cat([learner[i, 1 : len(lp) + 1] for i, lp in enumerate(lps)])
            m, w, counted = logprob_difference(torch.cat([torch.tensor(lp) for lp in lps]), ours, self.cfg.sync_min_prob)
            if not counted:
                raise SyncError(f"weight sync check: no probe token has probability >= sync_min_prob={self.cfg.sync_min_prob} "
                                "under the learner; lower sync_min_prob")
            mean, worst = max(mean, m), max(worst, w)
        if mean > self.cfg.sync_tolerance:
            raise SyncError(
                f"weight sync check failed: vLLM engine log-probs differ from the learner's by {mean:.4g} on average "
                f"(max {worst:.4g}) on the probe's tokens of probability >= {self.cfg.sync_min_prob} (tolerance "
                f"sync_tolerance={self.cfg.sync_tolerance}); the engine is not running the trained weights"
            )
        return mean, worst

    def evaluate(self) -> dict[str, float]:
        """Greedy held-out score: task accuracy from a reward func/endpoint, the mean score from a reward model."""
        if not self.eval_rows:
            return {}
        if self.agent is not None:  # greedy episodes, scored by the agent
            flat = [g[0] for g in self.episodes(self.eval_rows, self.cfg.eval_data, 1, 0.0, self.cfg.seed, False)]
            out = {"eval_accuracy": sum(e.score for e in flat) / len(flat), "eval_turns": sum(e.turns for e in flat) / len(flat)}
            for k in sorted({k for e in flat for k in e.info}):
                counted = [e.info[k] for e in flat if k in e.info and not math.isnan(e.info[k])]
                if counted:
                    out[f"eval_{k}"] = sum(counted) / len(counted)
            return out
        groups = self.generate([self._render(r) for r in self.eval_rows], 1, 0.0, self.cfg.seed)
        samples = Samples.of(list(range(len(self.eval_rows))), groups, self.tok.pad_token_id, with_logp=False)
        if self.grader is not None:
            from stages.common.graders import grade

            label = self.cfg.eval_data.label_key
            hits = [grade(self.grader, self.tok.decode(r, skip_special_tokens=True), row[label], f"eval row {i + 1}")
                    for i, (r, row) in enumerate(zip(samples.response_ids, self.eval_rows, strict=True))]
            return {"eval_accuracy": sum(hits) / len(hits)}
        scores = self.rewards(self.eval_rows, samples)["scores"]
        return {"eval_accuracy" if self.reward_actor is None else "eval_reward": scores.mean().item()}

    def save_state(self, step: int, probe: dict[str, torch.Tensor]) -> None:
        """Learner and critic state (DeepSpeed checkpoints) plus the driver's own (the step, the KL coefficient,
        the probe) in ``state/step<N>``, then the manifest that makes it the state to resume from."""
        from safetensors.torch import save_file

        state = self.run_dir / "state"
        folder = state / tag_of(step)
        self.get([lr.save_state.remote(str(folder), step, "policy") for lr in self.learners], "learner.save_state")
        self.get([c.save_state.remote(str(folder), step, "critic") for c in self.critics], "critic.save_state")
        save_file({k: v.contiguous() for k, v in probe.items()}, str(folder / "probe.safetensors"))
        (folder / "driver.json").write_text(json.dumps({"step": step, "kl_coef": self.kl.value}))
        commit_state(state, step, self.cfg.train.keep_last)

    def resume(self) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Load the committed state (if any; verified against its manifest first) and push its weights to
        the engines before the first rollout."""
        from safetensors.torch import load_file

        state = self.run_dir / "state"
        saved = resumable_state(state)
        if saved is None:
            return 0, None
        folder = state / saved.tag
        driver = read_json_state(state, saved, "driver.json")
        steps = self.get([lr.load_state.remote(str(folder), "policy") for lr in self.learners], "learner.load_state")
        steps += self.get([c.load_state.remote(str(folder), "critic") for c in self.critics], "critic.load_state")
        if any(s != driver["step"] for s in steps):
            raise RuntimeError(f"{state}: learner/critic state is at steps {steps}, driver state at {driver['step']}")
        self.kl.value = driver["kl_coef"]
        probe = load_file(str(folder / "probe.safetensors"))
        self.sync(probe)
        return driver["step"], probe

    def log_rollouts(self, step: int, samples: Samples, scored: Scores) -> None:
        """The step's samples as token ids and text, with their rewards: rollouts/step_N.jsonl."""
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        per = self.cfg.rollout.n_samples_per_prompt
        with open(folder / f"step_{step}.jsonl", "w") as f:
            for k, (p, r, text) in enumerate(zip(samples.prompt_ids, samples.response_ids, samples.texts, strict=True)):
                f.write(json.dumps({"prompt_index": samples.prompt_index[k // per], "prompt_ids": p, "response_ids": r,
                                    "response": text, "reward": scored.rewards[k].item(),
                                    "truncated": bool(samples.truncated[k]),
                                    # an agent's episodes: 1 on the model's tokens, 0 on the environment's
                                    **({"action_mask": samples.response_mask[k, len(p) : len(p) + len(r)].tolist()}
                                       if self.agent is not None else {})}) + "\n")

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        from stages.common.trainer import MetricsWriter

        cfg, plan = self.cfg, self.plan
        start, probe = self.resume() if cfg.train.resume else (0, None)
        writer = MetricsWriter(self.run_dir, start, enabled=True, prefix="rl")
        initial, final = self.evaluate(), None
        if start == 0 and initial:
            writer.write(0, initial)  # step 0: the starting policy's held-out metrics, where the curves begin
        history = []
        n_samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        # async: the engines sample up to max_staleness steps ahead while the learners train; a weight push
        # queues behind them on each engine, so step k's batch comes from weights at most max_staleness old
        ahead = cfg.rollout.max_staleness if cfg.rollout.async_ else 0
        pending: collections.deque = collections.deque()
        for step in tqdm(range(start, cfg.max_steps), desc="rl", disable=not cfg.train.progress_bar):
            t, t0 = {}, time.perf_counter()
            self.reward_time = 0.0
            # the later ones sample while this trains (an agent's episodes run turn by turn in collect)
            while self.agent is None and len(pending) < 1 + ahead and step + len(pending) < cfg.max_steps:
                pending.append(self.start_rollout(step + len(pending)))
            samples, scored, filtered = self.collect(step, pending.popleft() if pending else None)
            t["generate_s"] = time.perf_counter() - t0 - self.reward_time  # with async: the wait for the batch
            t["reward_s"] = self.reward_time
            if cfg.log_rollouts_every and step % cfg.log_rollouts_every == 0:
                self.log_rollouts(step + 1, samples, scored)
            if probe is None:  # a fixed probe: the first samples of the first step
                probe = {k: v[: len(self.learners) * 2] for k, v in samples.tensors().items()}
                self.verify(probe) if cfg.verify_sync else None
            t1 = time.perf_counter()
            forward = self.forward(samples)
            t["reference_s"] = time.perf_counter() - t1
            exp = make_experience(plan, cfg, samples, scored, forward, self.kl.value)
            t1 = time.perf_counter()
            m = self.update(exp, step)
            t["train_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            sync_mean, sync_max = (0.0, 0.0) if self.policy_frozen(step) else self.sync(probe)  # frozen: nothing to push
            t["sync_s"] = time.perf_counter() - t1
            mask = samples.response_mask.float()
            kl_sum = m.pop("kl_sum", 0.0)
            # measured on the samples (KL in the reward, or old log-probs at hand), else by the learners' update
            mean_kl = float(exp.kl.sum() / mask.sum()) if exp.kl is not None else kl_sum / max(float(mask.sum()), 1.0)
            if exp.kl is not None:
                self.kl.update(mean_kl, n_samples)
            if plan.rollout_logp and forward.old_logp is not None:
                m["rollout_logprob_diff"] = self.rollout_logprob_diff(samples, forward.old_logp)
            t["total_s"] = time.perf_counter() - t0
            lengths = mask.sum(-1)
            m = {
                "reward_mean": scored.rewards.mean().item(),
                "reward_std": scored.rewards.std().item(),
                "shaped_reward_mean": exp.shaped.mean().item(),  # after the length penalties
                "accuracy": scored.scores.mean().item(),
                "kl": mean_kl,
                "kl_coef": self.kl.value,
                "response_length": lengths.mean().item(),
                "truncated_share": samples.truncated.float().mean().item(),
                **filtered,
                "sync_logprob_diff": sync_mean,
                "sync_max_logprob_diff": sync_max,
                **m,
                # NaN: not counted (e.g. an agent's second-attempt success on episodes solved at the first)
                **{k: v.float().nanmean().item() for k, v in scored.extra_logs.items() if not v.float().isnan().all()},
                **t,
                "generated_tokens_per_s": float(lengths.sum().item()) / max(t["generate_s"], 1e-9),
            }
            if step + 1 == cfg.max_steps:  # the final eval, logged with the last step
                final = self.evaluate()
                m.update(final)
            elif cfg.eval_steps and (step + 1) % cfg.eval_steps == 0:
                m.update(self.evaluate())
            history.append({"step": step + 1, **m})
            writer.write(step + 1, m)
            report_progress(step + 1, cfg.max_steps, m)
            if cfg.train.save_steps and (step + 1) % cfg.train.save_steps == 0 and step + 1 < cfg.max_steps:
                self.save_state(step + 1, probe)
            if os.environ.get("RLHF_FAULT_STEP") == str(step + 1):  # test hook: the task dies here
                raise RuntimeError(f"injected fault after RL step {step + 1}")
        if final is None:  # resumed after the last step
            final = self.evaluate()
        writer.close()
        return {"initial_eval": initial, "final_eval": final, "last_step": history[-1] if history else {}}

    def export(self, out_dir: str) -> None:

        self.get([lr.export.remote(out_dir, self.policy_path) for lr in self.learners], "learner.export")


def _sum_dicts(dicts) -> dict[str, float]:
    """Key-wise sums over the per-rank answers of every pass (an iterable of lists of dicts)."""
    out: dict[str, float] = {}
    for answers in dicts:
        for d in answers:
            for k, v in d.items():
                out[k] = out.get(k, 0.0) + v
    return out


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(
    STAGE, RLConfig, run_rl,
    (Input("policy", (POLICY,), field="base"), Input("reward_model", (REWARD,), field="reward.model"),
     Input("critic", (REWARD, POLICY), field="critic.model", needed=lambda config: StepPlan.of(config).values)),
    output=trained_output(POLICY, ADAPTER),
    files=("data.paths", "eval_data.paths", "reward.func", "eval_grader", "rollout.agent"),
    plugins=("reward.func", "eval_grader", "rollout.agent"),
)

if __name__ == "__main__":
    main()
