"""The RL stage's actors on its Ray cluster, and the calls the loop makes on the trainer groups.

Started once per run (:func:`start_actors`): the policy learners (``train.world_size`` DeepSpeed ranks with
the reference beside them), the critic's ranks (an estimator that needs one), the vLLM engines and, with a
reward model, its scorer. The engines start while the learners load (their processes import vLLM and build the
engine meanwhile); on GPUs shared with the learners (``ray.colocate_all``) after them, so that vLLM sizes its
cache on what the learners left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.cluster import (
    Deadlines,
    Placement,
    actor_env,
    check_storage,
    start_group,
    uses_gpu,
    write_placement,
)
from stages.rl.config import RLConfig
from stages.rl.experience import Experience, Forward, Samples, StepPlan, updates_of
from stages.rl.rollout import EnginePool, engine_settings


@dataclass
class Trainers:
    """The policy learners and the critic's ranks (none without a critic), each list in rank order."""

    cfg: RLConfig
    learners: list
    critics: list
    deadlines: Deadlines
    gpu: bool = False  # the actors run on GPUs

    def call(self, refs, what: str):
        return self.deadlines.call(refs, what)

    def offload(self) -> None:
        """``train.enable_sleep``: every learner's states to host memory while the engines generate."""
        if self.cfg.train.enable_sleep:
            self.call([lr.offload_states.remote() for lr in self.learners], "learner.offload_states")

    def reload(self) -> None:
        if self.cfg.train.enable_sleep:
            self.call([lr.reload_states.remote() for lr in self.learners], "learner.reload_states")

    def forward(self, samples: Samples, plan: StepPlan) -> Forward:
        """The no-grad passes the plan asks for: old and reference log-probs (learners), values (critic)."""
        batch = samples.tensors()
        logps = [lr.logprobs.remote(s, policy=plan.old_logp, reference=plan.ref_logp)
                 for lr, s in zip(self.learners, _shards(batch, len(self.learners)))] if plan.old_logp or plan.ref_logp else []
        values = [c.values.remote(s) for c, s in zip(self.critics, _shards(batch, len(self.critics)))] if plan.values else []
        outs = self.call(logps, "learner.logprobs")
        cat = {k: torch.cat([o[k] for o in outs]) for k in (outs[0] if outs else {})}
        return Forward(cat.get("logp"), cat.get("ref_logp"), torch.cat(self.call(values, "critic.values")) if values else None)

    def policy_frozen(self, step: int) -> bool:
        """The first ``critic.freezing_steps`` steps train the critic only (OpenRLHF's freezing_actor_steps)."""
        return bool(self.critics) and step < self.cfg.critic.freezing_steps

    def update(self, exp: Experience, step: int, kl_coef: float) -> dict[str, float]:
        """``ppo_epochs`` passes of critic updates, then of policy updates (none while the critic warms up); their
        metrics per response token (losses, clip ratios, values, entropy) or per rank (grad norms, lr), and the
        learners' summed KL (``kl_sum``)."""
        out = self._update_critic(exp) if self.critics else {}
        if self.policy_frozen(step):
            return {**out, "policy_frozen": 1.0}
        tokens, epochs, n = _tokens(exp), self.cfg.algo.ppo_epochs, len(self.learners)
        shares = updates_of(exp, self.cfg, n)
        sums = _sum_dicts(self.call([lr.train.remote(u, kl_coef) for lr, u in zip(self.learners, shares)], "learner.train")
                          for _ in range(epochs))
        out.update(kl_sum=sums["kl"] / epochs, policy_loss=sums["policy_loss"] / (tokens * epochs),
                   clip_ratio=sums["clip_ratio"] / (tokens * epochs), entropy=sums["entropy"] / (tokens * epochs),
                   grad_norm=sums["grad_norm"] / (n * epochs), lr=sums["lr"] / (n * epochs))
        if "vllm_kl" in sums:
            out["vllm_kl"] = sums["vllm_kl"] / (tokens * epochs)
        return out

    def _update_critic(self, exp: Experience) -> dict[str, float]:
        tokens, epochs, n = _tokens(exp), self.cfg.algo.ppo_epochs, len(self.critics)
        shares = updates_of(exp, self.cfg, n)
        sums = _sum_dicts(self.call([c.train.remote(u) for c, u in zip(self.critics, shares)], "critic.train") for _ in range(epochs))
        return {"critic_loss": sums["critic_loss"] / (tokens * epochs), "value_mean": sums["values"] / (tokens * epochs),
                "critic_clip_ratio": sums["critic_clip_ratio"] / (tokens * epochs),
                "critic_grad_norm": sums["critic_grad_norm"] / (n * epochs), "critic_lr": sums["critic_lr"] / (n * epochs),
                "return_mean": float(exp.returns[exp.samples.response_mask.bool()].mean())}

    def save_state(self, folder: str, step: int) -> None:
        """Both groups' DeepSpeed checkpoints (weights, optimizer, scheduler) in ``folder`` (``policy``, ``critic``)."""
        self.call([lr.save_state.remote(folder, step, "policy") for lr in self.learners], "learner.save_state")
        self.call([c.save_state.remote(folder, step, "critic") for c in self.critics], "critic.save_state")

    def load_state(self, folder: str) -> list[int]:
        """Load both groups' state from ``folder``; the step each rank's state is at."""
        steps = self.call([lr.load_state.remote(folder, "policy") for lr in self.learners], "learner.load_state")
        return steps + self.call([c.load_state.remote(folder, "critic") for c in self.critics], "critic.load_state")

    def export(self, out_dir: str, tokenizer_path: str) -> None:
        """The policy as an HF folder (with LoRA: the adapter) in ``out_dir`` (``train.enable_sleep``: the learners'
        states back for the gather, then to host memory again)."""
        self.reload()
        self.call([lr.export.remote(out_dir, tokenizer_path) for lr in self.learners], "learner.export")
        self.offload()


def _tokens(exp: Experience) -> float:
    return max(float(exp.samples.response_mask.sum()), 1.0)


def _shards(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    size = batch["input_ids"].shape[0] // n
    return [{k: v[r * size : (r + 1) * size] for k, v in batch.items()} for r in range(n)]


def _sum_dicts(dicts) -> dict[str, float]:
    """Key-wise sums over the per-rank answers of every pass (an iterable of lists of dicts)."""
    out: dict[str, float] = {}
    for answers in dicts:
        for d in answers:
            for k, v in d.items():
                out[k] = out.get(k, 0.0) + v
    return out


def start_actors(cfg: RLConfig, plan: StepPlan, policy_path: str, critic_path: str | None, reward_model_path: str | None,
                 deadlines: Deadlines, run_dir: Path) -> tuple[Trainers, EnginePool, object | None]:
    """Every actor of the run, started and set up: the trainer groups, the engines, the reward model's scorer. On a
    user's cluster (``cluster.address``) every node placed is first checked to see ``run_dir`` and the inputs;
    ``run_dir/placement.json`` says where each learner, critic rank and engine runs."""
    import ray

    from stages.common.scoring import RewardModelScorer
    from stages.rl.critic import Critic
    from stages.rl.learner import Learner
    from stages.rl.rollout import RolloutEngine

    n, ro = cfg.train.world_size, cfg.rollout
    gpu, remote = uses_gpu(cfg.cluster.gpu), bool(cfg.cluster.address)
    cfg.check_device(gpu)
    place = Placement(n, ro.num_engines, ro.tensor_parallel_size, n if plan.values else 0, cfg.ray.colocate_all, gpu, deadlines,
                      cfg.cluster.strategy, remote, scorer=bool(reward_model_path))
    if remote:
        inputs = [p for p in (policy_path, critic_path, reward_model_path) if p]
        check_storage(place.pg, place.bundles, run_dir, inputs, cfg.cluster.connect_timeout_s)
    # learners, critic and engines take turns, so each learner gets its share of the cores, the engines every core
    cores = os.cpu_count() or 1
    learner_env, engine_env = actor_env(threads=cores // n), actor_env(threads=cores)
    config = cfg.model_dump(mode="json")
    updates = ro.rollout_batch_size * ro.n_samples_per_prompt // cfg.train.train_batch_size * cfg.algo.ppo_epochs
    frozen = cfg.critic.freezing_steps if plan.values else 0

    def start_engines() -> list:
        settings = engine_settings(cfg, colocated=gpu and cfg.ray.colocate_all)
        return [ray.remote(RolloutEngine).options(runtime_env={"env_vars": engine_env}, **place.engine(i)).remote(
                    policy_path, index=i, seed=cfg.seed + i, settings=settings)
                for i in range(ro.num_engines)]

    engines_wait = gpu and cfg.ray.colocate_all
    engines = [] if engines_wait else start_engines()
    learners, setups, learner_nodes = start_group(Learner, n, place.rank, learner_env, deadlines, config, policy_path,
                                   (cfg.max_steps - frozen) * updates)
    critics, critic_setups, critic_nodes = start_group(Critic, n, place.critic, learner_env, deadlines, config, critic_path,
                                                       cfg.max_steps * updates) if plan.values else ([], [], [])
    deadlines.startup(setups, "learner.setup")
    deadlines.startup(critic_setups, "critic.setup")
    if engines_wait:
        engines = start_engines()
    deadlines.startup([e.ready.remote() for e in engines], "engine.ready")
    write_placement(run_dir / "placement.json", {"learners": learner_nodes, "critics": critic_nodes,
                                                  "engines": deadlines.startup([e.node.remote() for e in engines], "engine.node")})
    scorer = None
    if reward_model_path:  # the reward model is served from its own actor: on GPUs in the learners' dtype, on CPU in fp32
        scorer = (ray.remote(RewardModelScorer).options(runtime_env={"env_vars": engine_env}, **place.scorer())
                  .remote(reward_model_path, cfg.algo.normalize_reward, dtype=cfg.train.dtype if gpu else "fp32"))
    return Trainers(cfg, learners, critics, deadlines, gpu), EnginePool(engines, deadlines.call, ro.max_new_tokens, sleeps=ro.enable_sleep), scorer
