"""The RL stage: its own Ray cluster, vLLM rollout engines, DeepSpeed ZeRO-3 learners, verified sync.

The loop, top to bottom, once per step:
sample prompts -> generate ``n_samples_per_prompt`` responses in vLLM (token ids) -> rewards ->
policy (old) and reference log-probs on the learners -> advantages (``algorithms``) -> PPO/GSPO
updates for ``ppo_epochs`` -> push the weights to every engine -> verify on a probe -> metrics.

Token-in-token-out: the learners train on exactly the token ids vLLM produced.

Run: ``python -m stages.rl recipes/rl/tiny.yaml base=runs/sft-<key>/checkpoint``
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from checkpoints import CheckpointRef, commit, require_kind, staging, verify
from datasets_prep.loading import check_prompt_label_row, load_rows
from datasets_prep.packing import BatchSchedule
from datasets_prep.sft import render_prompt
from stages.common.launcher import PROJECT_ROOT
from stages.common.progress import report_progress
from stages.common.stage import POLICY, REWARD, Input, StageRun, StageSpec, print_result
from stages.rl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, AdvantageInput, aggregation_normaliser
from stages.rl.config import RLConfig
from stages.rl.rewards import FuncReward, HttpReward, RewardError

STAGE = "rl"


class SyncError(RuntimeError):
    """vLLM's log-probs after a weight push do not match the learner's."""


def make_reward_source(cfg: RLConfig):
    if cfg.reward.func:
        return FuncReward(cfg.reward.func)
    if cfg.reward.url:
        return HttpReward(cfg.reward.url, cfg.reward.timeout_s, cfg.reward.retries)
    raise RewardError("reward: no source given (set reward.func, reward.url or reward.model)")


def _env() -> dict[str, str]:
    keep = ("TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_CPU_KVCACHE_SPACE",
            "RLHF_FAULT_STEP", "RLHF_FAULT_RANK", "RLHF_FAULT_MODE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


@contextmanager
def ray_cluster(cfg: RLConfig):
    """A private local Ray cluster for this task (or the one at ``ray.address``); always shut down."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tmp = None
    # SIGTERM (a killed task, a stopped worker) must unwind through the shutdown below like Ctrl-C does
    previous = None
    if threading.current_thread() is threading.main_thread():
        def _terminate(signum, frame):
            raise SystemExit(f"RL stage stopped by signal {signum}")

        previous = signal.signal(signal.SIGTERM, _terminate)
    import psutil  # a dependency of DeepSpeed and vLLM

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": _env()}, log_to_driver=True)
    else:
        tmp = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")  # short: Ray's socket paths are length-limited
        cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, cfg.train.world_size)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=tmp,
                 runtime_env={"env_vars": _env()}, log_to_driver=True)
    try:
        yield tmp
    finally:
        # a local cluster's raylet, GCS and workers descend from this process; after shutdown the
        # workers exit on their own a moment later: wait for them (and end any that linger)
        ours = [p for p in psutil.Process().children(recursive=True) if p.pid not in before] if tmp else []
        ray.shutdown()
        _, alive = psutil.wait_procs(ours, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_rl(config: RLConfig, policy: CheckpointRef, reward_model: CheckpointRef | None = None, *,
           run: StageRun | None = None) -> CheckpointRef:
    """Train ``policy`` with RL against the configured reward source; returns the final checkpoint."""
    from transformers import AutoTokenizer

    verify(policy)
    require_kind(policy, ("full",), "the RL policy")
    if config.lora.enabled:
        raise ValueError("lora: RL with LoRA adapters is not supported yet; train the full model (lora.rank=0)")
    if reward_model is None and config.reward.model:
        from checkpoints import load_ref

        reward_model = load_ref(config.reward.model)
    run = SPEC.identify(config, {"policy": policy, "reward_model": reward_model}, run)
    if reward_model is not None:
        verify(reward_model)
        require_kind(reward_model, ("reward",), "the RL reward model")
        reward_fn = None
    else:
        reward_fn = make_reward_source(config)  # fails fast on a bad reward file
    tokenizer = AutoTokenizer.from_pretrained(policy.path)
    rows = load_rows(config.data, check_prompt_label_row(config.data))
    eval_rows = load_rows(config.eval_data, check_prompt_label_row(config.eval_data)) if config.eval_data else []
    if len(rows) < config.rollout.rollout_batch_size:
        raise ValueError(f"{', '.join(config.data.paths)}: {len(rows)} prompts, fewer than rollout_batch_size={config.rollout.rollout_batch_size}")
    run_dir = run.prepare()
    dest = run_dir / "checkpoint"
    with staging(dest) as tmp, ray_cluster(config):
        loop = RLLoop(config, policy.path, tokenizer, rows, eval_rows, reward_fn, run_dir,
                      reward_model.path if reward_model else None)
        summary = loop.run()
        loop.export(str(tmp))
        return commit(tmp, dest, stage=STAGE, kind="full", config_hash=run.key, parent=policy, extra=summary)


def place(cfg: RLConfig):
    """A placement group for the task's actors and the options that put each actor in its bundle.

    CPU: one 1-CPU bundle per learner rank; engines and the reward model take no CPU reservation (they
    run while the learners wait). GPU: one GPU per learner rank, and per engine ``tensor_parallel_size``
    GPUs of their own, or with ``ray.colocate_all`` a share of the learners' GPUs.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n, engines = cfg.train.world_size, cfg.rollout.num_engines
    gpu = torch.cuda.is_available()
    bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(n)]
    own_engine_bundles = gpu and not cfg.ray.colocate_all
    if own_engine_bundles:
        bundles += [{"GPU": cfg.rollout.tensor_parallel_size} for _ in range(engines)]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())

    def at(bundle: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)}

    def learner_opts(rank: int) -> dict:
        return {"num_cpus": 1, "num_gpus": (0.5 if cfg.ray.colocate_all else 1) if gpu else 0, **at(rank)}

    def engine_opts(i: int) -> dict:
        if own_engine_bundles:
            return {"num_cpus": 0, "num_gpus": cfg.rollout.tensor_parallel_size, **at(n + i)}
        return {"num_cpus": 0, "num_gpus": (0.5 / max(1, engines // n)) if gpu else 0, **at(i % n)}

    return pg, learner_opts, engine_opts


class RLLoop:
    def __init__(self, cfg: RLConfig, policy_path: str, tokenizer, rows, eval_rows, reward_fn, run_dir: Path,
                 reward_model_path: str | None = None):
        import ray

        from stages.rl.learner import Learner
        from stages.rl.rewards import RewardModelScorer
        from stages.rl.rollout import RolloutEngine

        self.cfg, self.tok, self.rows, self.eval_rows, self.reward_fn, self.run_dir = cfg, tokenizer, rows, eval_rows, reward_fn, run_dir
        self.policy_path = policy_path
        n = cfg.train.world_size
        updates_per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt // cfg.train.train_batch_size
        # Ray pins OMP_NUM_THREADS to an actor's CPU count (1 for num_cpus=0): give each its share of the
        # machine instead; learners and engines take turns, so the engines may use every core
        cores = os.cpu_count() or 1
        learner_env = {"env_vars": {**_env(), "OMP_NUM_THREADS": str(max(1, cores // n))}}
        engine_env = {"env_vars": {**_env(), "OMP_NUM_THREADS": str(cores)}}
        self.pg, learner_opts, engine_opts = place(cfg)
        self.learners = [
            ray.remote(Learner).options(runtime_env=learner_env, **learner_opts(r)).remote(r, n) for r in range(n)
        ]
        master = ray.get(self.learners[0].address.remote())
        total = cfg.max_steps * updates_per_step * cfg.algo.ppo_epochs
        ray.get([lr.setup.remote(cfg.model_dump(mode="json"), policy_path, total, master) for lr in self.learners])
        self.engines = [
            ray.remote(RolloutEngine).options(runtime_env=engine_env, **engine_opts(i)).remote(
                policy_path, seed=cfg.seed + i, dtype=cfg.rollout.dtype, max_model_len=cfg.rollout.max_model_len
            )
            for i in range(cfg.rollout.num_engines)
        ]
        ray.get([e.ready.remote() for e in self.engines])
        self.reward_actor = None
        if reward_model_path:  # the reward model is served from its own actor, sharing the CPUs like vLLM
            self.reward_actor = (
                ray.remote(num_cpus=0)(RewardModelScorer).options(runtime_env=engine_env)
                .remote(reward_model_path, cfg.algo.normalize_reward)
            )
        self.kl_coef = cfg.algo.init_kl_coef
        self.prompt_ids = [self._render(r) for r in rows]

    # -- pieces of a step, in the order the loop calls them -------------------------------------------

    def _render(self, row: dict) -> list[int]:
        text = render_prompt(self.tok, row[self.cfg.data.prompt_key], self.cfg.data)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, logprobs: bool = False):
        import ray

        shards = [prompt_ids[i :: len(self.engines)] for i in range(len(self.engines))]
        outs = ray.get([
            e.generate.remote(s, n=n, max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=temperature,
                              seed=seed + i * 1_000_003, logprobs=logprobs)
            for i, (e, s) in enumerate(zip(self.engines, shards))
        ])
        result: list = [None] * len(prompt_ids)
        for i, out in enumerate(outs):
            for j, group in enumerate(out):
                result[i + j * len(self.engines)] = group
        return result

    def rewards(self, rows: list[dict], groups) -> dict[str, Any]:
        """The reward source's answer for every sample of ``groups`` (one group per row, in order)."""
        if self.reward_actor is not None:
            import ray

            from stages.rl.rewards import check_result

            seqs = [c.prompt_ids + c.token_ids for group in groups for c in group]
            return check_result({"rewards": ray.get(self.reward_actor.score.remote(seqs))}, len(seqs), "reward model")
        queries, prompts, labels = [], [], []
        for row, group in zip(rows, groups):
            prompt_text = self.tok.decode(group[0].prompt_ids)
            for c in group:
                queries.append(prompt_text + self.tok.decode(c.token_ids, skip_special_tokens=True))
                prompts.append(prompt_text)
                labels.append(row[self.cfg.data.label_key])
        return self.reward_fn(queries, prompts, labels)

    def to_batch(self, groups) -> dict[str, torch.Tensor]:
        seqs = [(c.prompt_ids, c.token_ids) for group in groups for c in group]
        width = max(len(p) + len(r) for p, r in seqs)
        b = len(seqs)
        ids = torch.full((b, width), self.tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        resp = torch.zeros((b, width), dtype=torch.long)
        for i, (p, r) in enumerate(seqs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            attn[i, : len(p) + len(r)] = 1
            resp[i, len(p) : len(p) + len(r)] = 1
        return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}

    @staticmethod
    def rollout_logprob_diff(groups, logp: torch.Tensor) -> float:
        """Mean |vLLM's sampling log-prob - the learners' old log-prob| over every response token of the step:
        the engines and the learners hold the same weights, so this stays at rounding level unless a sync
        went wrong (a whole-batch check beside the probe's)."""
        diffs = []
        for i, c in enumerate(c for group in groups for c in group):
            start = len(c.prompt_ids)
            diffs.append((torch.tensor(c.logprobs) - logp[i, start : start + len(c.token_ids)]).abs())
        return torch.cat(diffs).mean().item() if diffs else 0.0

    def _shards(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        n = len(self.learners)
        size = batch["input_ids"].shape[0] // n
        return [{k: v[r * size : (r + 1) * size] for k, v in batch.items()} for r in range(n)]

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy that sampled is the one being updated."""
        samples = self.cfg.rollout.rollout_batch_size * self.cfg.rollout.n_samples_per_prompt
        kl_reward = self.cfg.algo.init_kl_coef > 0 and self.cfg.algo.kl_in_reward  # needs them before the update
        return self.cfg.algo.ppo_epochs == 1 and samples == self.cfg.train.train_batch_size and not kl_reward

    def logprobs(self, batch):
        """Old-policy log-probs (skipped when on-policy: then they equal the current ones) and reference log-probs."""
        import ray

        outs = ray.get([lr.logprobs.remote(s, policy=not self.on_policy) for lr, s in zip(self.learners, self._shards(batch))])
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Split the step's samples into optimizer steps, each into rank shares; one call per rank."""
        import ray

        tb, n = self.cfg.train.train_batch_size, len(self.learners)
        total = batch["input_ids"].shape[0]
        per_rank: list[list[dict]] = [[] for _ in range(n)]
        for start in range(0, total, tb):
            chunk = {k: v[start : start + tb] for k, v in batch.items()}
            masks = [chunk["response_mask"]]
            norm = aggregation_normaliser(masks, self.cfg.algo.loss_agg, self.cfg.rollout.max_new_tokens)
            for r, shard in enumerate(self._shards(chunk)):
                per_rank[r].append({"batch": shard, "norm": norm})
        sums: dict[str, float] = {}
        for _ in range(self.cfg.algo.ppo_epochs):
            outs = ray.get([lr.train.remote(u, self.kl_coef) for lr, u in zip(self.learners, per_rank)])
            for o in outs:
                for k, v in o.items():
                    sums[k] = sums.get(k, 0.0) + v
        tokens = max(sums.pop("tokens"), 1.0)
        epochs = self.cfg.algo.ppo_epochs
        return {
            "kl_sum": sums["kl"] / epochs,
            "policy_loss": sums["policy_loss"] / tokens,
            "clip_ratio": sums["clip_ratio"] / tokens,
            "entropy": sums["entropy"] / tokens,
            "grad_norm": sums["grad_norm"] / (n * epochs),
            "lr": sums["lr"] / (n * epochs),
        }

    def sync(self, probe: dict[str, torch.Tensor]) -> float:
        """Push the learners' weights to every engine; return the probe's max |log-prob difference|."""
        import ray

        data = ray.get([lr.weights_bytes.remote(self.cfg.rollout.dtype) for lr in self.learners])[0]
        if os.environ.get("RLHF_FAULT_SKIP_PUSH") != "1":  # test hook: a push that silently does nothing
            ref = ray.put(data)
            ray.get([e.update_weights.remote(ref) for e in self.engines])
        return self.verify(probe) if self.cfg.verify_sync else (float("nan"), float("nan"))

    def verify(self, probe: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Mean and max |log-prob difference| between every engine and the learners on the probe.

        The check is on the mean over the probe's tokens: bf16 rounding moves single unlikely tokens by
        more than a real update does, while a stale or half-loaded engine shifts them all."""
        import ray

        learner = ray.get([lr.probe_logprobs.remote(probe) for lr in self.learners])[0]
        seqs = [row[row_mask.bool()].tolist() for row, row_mask in zip(probe["input_ids"], probe["attention_mask"])]
        engine_lps = ray.get([e.sequence_logprobs.remote(seqs) for e in self.engines])
        mean, worst = 0.0, 0.0
        for lps in engine_lps:
            diffs = torch.cat([(torch.tensor(lp) - learner[i, 1 : len(lp) + 1]).abs() for i, lp in enumerate(lps)])
            mean, worst = max(mean, diffs.mean().item()), max(worst, diffs.max().item())
        if mean > self.cfg.sync_tolerance:
            raise SyncError(
                f"weight sync check failed: vLLM engine log-probs differ from the learner's by {mean:.4g} on average "
                f"(max {worst:.4g}) on the probe (tolerance sync_tolerance={self.cfg.sync_tolerance}); "
                "the engine is not running the trained weights"
            )
        return mean, worst

    def evaluate(self) -> dict[str, float]:
        """Greedy held-out score: task accuracy from a reward func/endpoint, the mean score from a reward model."""
        if not self.eval_rows:
            return {}
        groups = self.generate([self._render(r) for r in self.eval_rows], 1, 0.0, self.cfg.seed)
        scores = self.rewards(self.eval_rows, groups)["scores"]
        return {"eval_accuracy" if self.reward_actor is None else "eval_reward": scores.mean().item()}

    def save_state(self, step: int, probe: dict[str, torch.Tensor]) -> None:
        """Learner state (DeepSpeed checkpoint) plus the driver's own: the step, the KL coefficient, the probe."""
        import ray
        from safetensors.torch import save_file

        state = self.run_dir / "state"
        ray.get([lr.save_state.remote(str(state), step) for lr in self.learners])
        save_file({k: v.contiguous() for k, v in probe.items()}, str(state / "probe.safetensors"))
        tmp = state / "driver.json.tmp"
        tmp.write_text(json.dumps({"step": step, "kl_coef": self.kl_coef}))
        tmp.replace(state / "driver.json")

    def resume(self) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Load the latest state (if any) and push its weights to the engines before the first rollout."""
        import ray
        from safetensors.torch import load_file

        state = self.run_dir / "state"
        if not (state / "driver.json").is_file():
            return 0, None
        driver = json.loads((state / "driver.json").read_text())
        steps = ray.get([lr.load_state.remote(str(state)) for lr in self.learners])
        if steps[0] != driver["step"]:
            raise RuntimeError(f"{state}: learner state is at step {steps[0]}, driver state at {driver['step']}")
        self.kl_coef = driver["kl_coef"]
        probe = load_file(str(state / "probe.safetensors"))
        self.sync(probe)
        return driver["step"], probe

    def log_rollouts(self, step: int, idx: list[int], groups, rewards: dict[str, Any]) -> None:
        """The step's samples as token ids and text, with their rewards: rollouts/step_N.jsonl."""
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        k = 0
        with open(folder / f"step_{step}.jsonl", "w") as f:
            for i, group in zip(idx, groups):
                for c in group:
                    f.write(json.dumps({"prompt_index": i, "prompt_ids": c.prompt_ids, "response_ids": c.token_ids,
                                        "response": c.text, "reward": rewards["rewards"][k].item()}) + "\n")
                    k += 1

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        cfg, ro, algo = self.cfg, self.cfg.rollout, self.cfg.algo
        schedule = BatchSchedule(len(self.rows), ro.rollout_batch_size, ro.rollout_batch_size, 1, cfg.seed)
        metrics_path = self.run_dir / "metrics.jsonl"
        start, probe = self.resume() if cfg.train.resume else (0, None)
        kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["step"] <= start] if metrics_path.is_file() else []
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
        tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start + 1)
        initial = self.evaluate()
        history = []
        for step in tqdm(range(start, cfg.max_steps), desc="rl", disable=not cfg.train.progress_bar):
            t = {}
            t0 = time.perf_counter()
            idx = schedule.global_batch(step)
            # vLLM's sampling log-probs only when the learners compute old log-probs to compare them with
            groups = self.generate([self.prompt_ids[i] for i in idx], ro.n_samples_per_prompt, ro.temperature,
                                   cfg.seed * 100_003 + step, logprobs=not self.on_policy)
            t["generate_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            rewards = self.rewards([self.rows[i] for i in idx], groups)
            t["reward_s"] = time.perf_counter() - t1
            batch = self.to_batch(groups)
            if cfg.log_rollouts_every and step % cfg.log_rollouts_every == 0:
                self.log_rollouts(step + 1, idx, groups, rewards)
            if probe is None:  # a fixed probe: the first samples of the first step
                probe = {k: v[: len(self.learners) * 2] for k, v in batch.items()}
                self.verify(probe) if cfg.verify_sync else None
            t1 = time.perf_counter()
            lps = self.logprobs(batch)
            t["reference_s"] = time.perf_counter() - t1
            mask = batch["response_mask"].float()
            kl = None
            if "ref_logp" in lps and "logp" in lps:
                kl = torch.where(mask.bool(), KL_ESTIMATORS[algo.kl_estimator](lps["logp"], lps["ref_logp"]), 0.0)
            scores = rewards["rewards"].double()
            lengths = mask.sum(-1)
            if algo.overlong_buffer:
                from stages.rl.algorithms import overlong_penalty

                scores = scores + overlong_penalty(lengths, ro.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty).double()
            adv_in = AdvantageInput(
                scores.float(), mask, ro.n_samples_per_prompt, kl=kl if algo.kl_in_reward else None,
                kl_coef=self.kl_coef, gamma=algo.gamma, reward_clip=algo.reward_clip,
            )
            advantages, _ = ADVANTAGE_ESTIMATORS[algo.advantage_estimator](adv_in)
            train_batch = {**batch, "advantages": advantages.float()}
            mismatch = {}
            if "logp" in lps:
                train_batch["old_logp"] = lps["logp"]
                if groups[0][0].logprobs is not None:
                    mismatch["rollout_logprob_diff"] = self.rollout_logprob_diff(groups, lps["logp"])
            if "ref_logp" in lps:
                train_batch["ref_logp"] = lps["ref_logp"]
            t1 = time.perf_counter()
            train_metrics = self.train(train_batch)
            t["train_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            sync_mean, sync_max = self.sync(probe)
            t["sync_s"] = time.perf_counter() - t1
            if kl is not None:
                mean_kl = float((kl.sum() / mask.sum()).item())
            else:  # measured by the learners during the update (KL as a loss term, or no reference)
                mean_kl = train_metrics.pop("kl_sum") / max(float(mask.sum()), 1.0)
            train_metrics.pop("kl_sum", None)
            if algo.kl_target is not None and kl is not None:  # adaptive KL (Ziegler et al. 2019)
                err = max(min(mean_kl / algo.kl_target - 1, 0.2), -0.2)
                self.kl_coef *= 1 + err * ro.rollout_batch_size * ro.n_samples_per_prompt / algo.kl_horizon
            t["total_s"] = time.perf_counter() - t0
            m = {
                "step": step + 1,
                "reward_mean": rewards["rewards"].mean().item(),
                "reward_std": rewards["rewards"].std().item(),
                "accuracy": rewards["scores"].mean().item(),
                "kl": mean_kl,
                "kl_coef": self.kl_coef,
                "response_length": lengths.mean().item(),
                "sync_logprob_diff": sync_mean,
                "sync_max_logprob_diff": sync_max,
                **mismatch,
                **train_metrics,
                **{k: v.mean().item() for k, v in rewards["extra_logs"].items()},
                **t,
                "generated_tokens_per_s": float(lengths.sum().item()) / max(t["generate_s"], 1e-9),
            }
            if cfg.eval_steps and (step + 1) % cfg.eval_steps == 0 and step + 1 < cfg.max_steps:
                m.update(self.evaluate())
            history.append(m)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
            for k, v in m.items():
                if k != "step":
                    tb.add_scalar(f"rl/{k}", v, step + 1)
            report_progress(step + 1, cfg.max_steps)
            if cfg.train.save_steps and (step + 1) % cfg.train.save_steps == 0 and step + 1 < cfg.max_steps:
                self.save_state(step + 1, probe)
            if os.environ.get("RLHF_FAULT_STEP") == str(step + 1):  # test hook: the task dies here
                raise RuntimeError(f"injected fault after RL step {step + 1}")
        final = self.evaluate()
        tb.close()
        return {"initial_eval": initial, "final_eval": final, "last_step": history[-1] if history else {}}

    def export(self, out_dir: str) -> None:
        import ray

        ray.get([lr.export.remote(out_dir, self.policy_path) for lr in self.learners])


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(
    STAGE, RLConfig, run_rl,
    (Input("policy", (POLICY,), field="base"), Input("reward_model", (REWARD,), field="reward.model")),
    files=("data.paths", "eval_data.paths", "reward.func"),
)

if __name__ == "__main__":
    main()
