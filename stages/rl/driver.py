"""The RL stage: its own Ray cluster, vLLM rollout engines, DeepSpeed ZeRO-3 learners, verified sync.

The step, top to bottom (:meth:`RLLoop.step`)::

    rollout    = sampler.collect(step, started)          # vLLM token ids, scored by the reward source -> Rollout
    forward    = trainers.forward(samples, plan)          # old/reference log-probs, values (no grad)   -> Forward
    experience = make_experience(plan, cfg, ..., kl)      # shaping, KL, advantages (pure)              -> Experience
    updates    = trainers.update(experience, step, kl)    # critic, then policy updates
    sync       = weight_sync.push()                       # learners -> every engine, verified on the probe
    metrics    = step_metrics(...)                        # pure

The seams: ``stages.common.cluster`` (the Ray cluster, deadlines, placement), ``actors`` (starting the actor
groups; the calls on the trainer groups), ``sampler`` (prompts, rollouts, agent episodes, dynamic filtering,
held-out eval), ``rewards`` (every source answers ``score(rows, samples)``), ``weight_sync``, ``experience``
and ``algorithms`` (pure math in registries), ``metrics``. Token-in-token-out: the learners train on exactly
the token ids vLLM produced.

Run: ``python -m stages.rl recipes/rl/tiny.yaml base=runs/sft-<key>/checkpoint``
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path
from typing import Any

from checkpoints import CheckpointRef, staging
from checkpoints.state import commit_state, read_json_state, resumable_state, tag_of
from datasets_prep.loading import DataError, check_prompt_label_row, load_rows
from stages.common.cluster import CallTimeout, Deadlines, ray_cluster  # noqa: F401  (CallTimeout: the stage's own error)
from stages.common.progress import report_progress
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
from stages.common.stage_run import commit_output
from stages.common.trainer import Best, MetricsWriter, maybe_inject_fault
from stages.rl.actors import Trainers, start_actors
from stages.rl.algorithms import ADVANTAGE_ESTIMATORS
from stages.rl.config import RLConfig
from stages.rl.experience import KLController, StepPlan, make_experience
from stages.rl.metrics import PhaseTimer, mean_kl, no_signal_reason, signal_metrics, step_metrics
from stages.rl.preflight import check_inputs, logged_metrics, plugins, preflight
from stages.rl.rewards import EpisodeReward, ModelReward, TextReward, WithEpisodeLogs, text_reward
from stages.rl.sampler import Rollout, Sampler
from stages.rl.weight_sync import SyncError, WeightSync  # noqa: F401  (SyncError: the stage's own error)

STAGE = "rl"


def run_rl(config: RLConfig, policy: CheckpointRef, reward_model: CheckpointRef | None = None,
           critic: CheckpointRef | None = None, *, run: StageRun | None = None) -> CheckpointRef:
    """Train ``policy`` with RL against the configured reward source; returns the final checkpoint.

    ``reward_model``: the reward source when given (the CLI and the flows resolve ``reward.model``). ``critic``
    (an estimator with a critic only): where the critic starts; unset, the reward model when there is one (as
    OpenRLHF), else the policy. Everything is checked before the cluster starts."""
    from transformers import AutoTokenizer

    run = SPEC.identify(config, {"policy": policy, "reward_model": reward_model, "critic": critic}, run)
    plan = StepPlan.of(config)
    critic_init = check_inputs(config, plan, policy, reward_model, critic)
    text = None if reward_model is not None or config.rollout.agent else text_reward(config)  # a bad file fails here
    agent, grader, tools = plugins(config)
    tokenizer = AutoTokenizer.from_pretrained(policy.path)
    rows = load_rows(config.data, check_prompt_label_row(config.data))
    eval_rows = load_rows(config.eval_data, check_prompt_label_row(config.eval_data)) if config.eval_data else []
    if len(rows) < config.rollout.rollout_batch_size:
        raise DataError(f"{', '.join(config.data.paths)}: {len(rows)} prompts, fewer than rollout_batch_size={config.rollout.rollout_batch_size}")
    images = check_images(config, policy, rows, eval_rows)
    cpus = config.ray.num_cpus or max(os.cpu_count() or 1, config.train.world_size)
    with run.claimed() as run_dir, staging(run_dir / "checkpoint") as tmp, ray_cluster(
            config.cluster.address, cpus, config.cluster.ship_code, config.cluster.connect_timeout_s):
        deadlines = Deadlines(config.ray.call_timeout_s, config.ray.startup_timeout_s)
        trainers, engines, scorer = start_actors(config, plan, policy.path, critic_init.path if critic_init else None,
                                                 reward_model.path if reward_model else None, deadlines, run_dir)
        rewards = EpisodeReward() if agent else ModelReward(scorer, deadlines.call) if scorer else \
            TextReward(text, tokenizer, config.data.label_key, keep_special=tools is not None)
        if tools is not None and not agent:  # tools-only episodes: scored by the reward source, their counts logged
            rewards = WithEpisodeLogs(rewards)
        sampler = Sampler(config, tokenizer, engines, rows, rewards, plan.rollout_logp, agent, tools, images)
        sync = WeightSync(config, trainers.learners, engines, deadlines, trainers.gpu, policy.path if images is not None else None)
        sync.connect()
        trainers.offload()  # train.enable_sleep: the engines generate first
        export = functools.partial(trainers.export, tokenizer_path=policy.path)  # with LoRA: the adapter, on its policy
        loop = RLLoop(config, plan, trainers, sampler, sync, run_dir, eval_rows, grader, export)
        summary = loop.run()
        export(str(tmp))
        lora = config.lora.enabled
        return commit_output(run_dir, tmp, config.train.save_best, dict(
            stage=STAGE, kind="adapter" if lora else "full", config_hash=run.key, parent=policy, base=policy if lora else None), summary)


def check_images(config: RLConfig, policy: CheckpointRef, rows: list[dict], eval_rows: list[dict]) -> list[list[str]] | None:
    """A vision-language policy's run, before the cluster starts: every row's images (``data.image_key``) open, and
    what is not supported with images is refused by name. Each row's image references, or None (a text run)."""
    from datasets_prep.sft import prompt_images
    from stages.common.vision import is_vision

    vision = is_vision(policy.path)
    for section, data in (("data", config.data), ("eval_data", config.eval_data)):
        if data is not None and data.image_key is not None and not vision:
            raise DataError(f"{section}.image_key is {data.image_key!r} but the policy {policy.path} is not a vision-language "
                            "model (its config.json has no vision_config); use one (e.g. tiny:tiny-vl) or drop image_key")
    if not vision:
        return None
    estimator = ADVANTAGE_ESTIMATORS[config.algo.advantage_estimator]
    if estimator.needs_critic:
        raise ValueError(f"algo.advantage_estimator={config.algo.advantage_estimator!r} needs a critic, which a vision-language "
                         "policy does not get (as OpenRLHF); use a critic-free estimator (group_norm, reinforce_baseline, rloo, ...)")
    for i, r in enumerate(eval_rows):  # their images open, and messages' image parts match them
        prompt_images(r, config.eval_data, config.eval_data.prompt_key, f"{config.eval_data.paths[0]} row {i + 1}")
    return [prompt_images(r, config.data, config.data.prompt_key, f"{config.data.paths[0]} row {i + 1}")[1]
            for i, r in enumerate(rows)]


class RLLoop:
    """The RL stage's loop: a step per :meth:`step`, held-out evals, state saved and resumed, metrics written."""

    def __init__(self, cfg: RLConfig, plan: StepPlan, trainers: Trainers, sampler: Sampler, sync: WeightSync,
                 run_dir: Path, eval_rows: list[dict], grader=None, export=None):
        """``export(folder)``: the policy written as the stage's output would be (``train.save_best``'s candidates)."""
        self.cfg, self.plan, self.trainers, self.sampler, self.sync = cfg, plan, trainers, sampler, sync
        self.run_dir, self.eval_rows, self.grader, self.export = run_dir, eval_rows, grader, export
        self.best: Best | None = None
        self.kl = KLController(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        self.silent: list[int] = []  # the steps in a row, up to now, with no learning signal
        self.warning: str | None = None  # the last step's, for the progress artifact
        self.stop: Exception | None = None  # what ends the run once the current step is logged

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        start = self.resume() if cfg.train.resume else 0
        if cfg.train.save_best is not None:  # a best of an earlier attempt carries over a resume only
            self.best = Best(cfg.train.save_best, self.run_dir, 0, fresh=start == 0)
        writer = MetricsWriter(self.run_dir, start, enabled=True, prefix="rl", config=cfg.model_dump(mode="json"))
        initial, final, last = self.evaluate(), None, {}
        if start == 0 and initial:
            writer.write(0, initial)  # step 0: the starting policy's held-out metrics, where the curves begin
        pending: collections.deque = collections.deque()
        for step in tqdm(range(start, cfg.max_steps), desc="rl", disable=not cfg.train.progress_bar):
            timer = PhaseTimer()
            with timer("generate_s"):  # with async: the wait for the batch sampled ahead
                rollout = self.sampler.collect(step, self.started(step, pending))
            timer.move(rollout.reward_s, "generate_s", "reward_s")
            last = self.step(step, rollout, timer)
            if step + 1 == cfg.max_steps:  # the final eval, logged with the last step
                final = self.evaluate()
                last.update(final)
            elif cfg.eval_steps and (step + 1) % cfg.eval_steps == 0:
                last.update(self.evaluate())
            self.finish_step(step + 1, last, writer)
            if self.stop is not None:
                writer.close()
                raise self.stop
        writer.close()
        return {"initial_eval": initial, "final_eval": self.evaluate() if final is None else final,  # None: resumed at the end
                "last_step": {"step": cfg.max_steps, **last} if last else {}}

    def started(self, step: int, pending: collections.deque):
        """The step's rollout, started now or earlier. Async: the engines sample up to ``max_staleness`` steps ahead
        while the learners train; a weight push queues behind them on each engine, so step k's batch comes from
        weights at most ``max_staleness`` updates old."""
        ahead = self.cfg.rollout.max_staleness if self.cfg.rollout.async_ else 0
        while len(pending) < 1 + ahead and step + len(pending) < self.cfg.max_steps:
            pending.append(self.sampler.start(step + len(pending)))
        return pending.popleft()

    def finish_step(self, done: int, metrics: dict[str, float], writer) -> None:
        """Log the step's metrics, save the state on its cadence (not after the last step), then the test hook."""
        writer.write(done, metrics)
        report_progress(done, self.cfg.max_steps, metrics, warning=self.warning)
        if self.best is not None:  # train.save_best: an improved step's policy to run_dir/best
            self.best.offer(done, metrics, lambda folder: self.export(str(folder)))
        save_steps = self.cfg.train.save_steps
        if save_steps and done % save_steps == 0 and done < self.cfg.max_steps:
            self.save_state(done)
        maybe_inject_fault(done, 0, after="RL step")  # test hook: the task dies here

    def step(self, step: int, rollout: Rollout, timer: PhaseTimer) -> dict[str, float]:
        """One step on the rollout collected for it; its metrics."""
        cfg = self.cfg
        if cfg.log_rollouts_every and step % cfg.log_rollouts_every == 0:
            self.log_rollouts(step + 1, rollout)
        self.trainers.reload()  # train.enable_sleep: the learners' states back
        self.sync.set_probe(rollout.samples)
        self.sync.engines.sleep()  # rollout.enable_sleep: the learners get the GPUs until the push
        with timer("reference_s"):
            forward = self.trainers.forward(rollout.samples, self.plan)
        exp = make_experience(self.plan, cfg, rollout.samples, rollout.scores, forward, self.kl.value)
        with timer("train_s"):
            updates = self.trainers.update(exp, step, self.kl.value)
        with timer("sync_s"):  # a frozen policy: nothing to push, unless sleeping engines freed their weights
            frozen = self.trainers.policy_frozen(step) and not self.sync.engines.asleep
            sync = (0.0, 0.0) if frozen else self.sync.push()
        self.trainers.offload()
        kl = mean_kl(exp, updates.pop("kl_sum", 0.0))
        if exp.kl is not None:
            self.kl.update(kl, len(rollout.samples.prompt_ids))
        signal = self.check_signal(step + 1, exp)
        return {**step_metrics(rollout, exp, updates, kl, self.kl.value, sync, timer.total()), **signal}

    def check_signal(self, done: int, exp) -> dict[str, float]:
        """The step's learning-signal metrics; a warning when it had none, and the stage's failure after
        ``algo.max_steps_without_signal`` such steps in a row (a run that learns nothing must not look like one that
        trained)."""
        cfg, per = self.cfg, self.cfg.rollout.n_samples_per_prompt
        group = ADVANTAGE_ESTIMATORS[cfg.algo.advantage_estimator].min_group > 1
        metrics = signal_metrics(exp, per, group)
        self.warning = None
        if not metrics["no_signal"]:
            self.silent = []
            return metrics
        self.silent.append(done)
        reason = no_signal_reason(exp, per)
        look = (f"look at the samples and their rewards (log_rollouts_every=1 writes {self.run_dir}/rollouts/step_N.jsonl) and "
                f"at the reward source ({_reward_source(cfg)})")
        self.warning = f"no learning signal at step {done}: {reason}, so every advantage is 0 and the policy did not move"
        print(f"[rl] WARNING: {self.warning}; {look}", flush=True)
        limit = cfg.algo.max_steps_without_signal
        if limit and len(self.silent) >= limit:  # raised once the step is logged
            self.stop = NoSignalError(
                f"RL: no learning signal in {len(self.silent)} steps in a row (steps {self.silent[0]}-{done}; "
                f"algo.max_steps_without_signal={limit}): {reason}, so {cfg.algo.advantage_estimator}'s advantages are all "
                f"0 and the policy has not changed. {look[0].upper()}{look[1:]}; a task too hard for the starting policy "
                "gives this too (a stronger SFT, more samples per prompt or a denser reward helps)")
        return metrics

    def evaluate(self) -> dict[str, float]:
        return self.sampler.evaluate(self.eval_rows, self.grader)

    def save_state(self, step: int) -> None:
        """Learner and critic state (DeepSpeed checkpoints) plus the driver's own (the step, the KL coefficient,
        the probe) in ``state/step<N>``, then the manifest that makes it the state to resume from."""
        from safetensors.torch import save_file

        state = self.run_dir / "state"
        folder = state / tag_of(step)
        self.trainers.save_state(str(folder), step)
        save_file({k: v.contiguous() for k, v in self.sync.probe.items()}, str(folder / "probe.safetensors"))
        (folder / "driver.json").write_text(json.dumps({"step": step, "kl_coef": self.kl.value}))
        commit_state(state, step, self.cfg.train.keep_last)

    def resume(self) -> int:
        """Load the committed state (if any; verified against its manifest first) and push its weights to the
        engines before the first rollout; the step it is at."""
        from safetensors.torch import load_file

        state = self.run_dir / "state"
        saved = resumable_state(state)
        if saved is None:
            return 0
        folder = state / saved.tag
        driver = read_json_state(state, saved, "driver.json")
        steps = self.trainers.load_state(str(folder))
        if any(s != driver["step"] for s in steps):
            raise RuntimeError(f"{state}: learner/critic state is at steps {steps}, driver state at {driver['step']}")
        self.kl.value = driver["kl_coef"]
        self.sync.probe = load_file(str(folder / "probe.safetensors"))
        self.trainers.reload()
        self.sync.push()
        self.trainers.offload()
        return driver["step"]

    def log_rollouts(self, step: int, rollout: Rollout) -> None:
        """The step's samples as token ids and text, with their rewards: rollouts/step_N.jsonl (an agent's
        episodes also with their action mask: 1 on the model's tokens, 0 on the environment's)."""
        samples, per = rollout.samples, self.cfg.rollout.n_samples_per_prompt
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        with open(folder / f"step_{step}.jsonl", "w") as f:
            for k, (p, r, text) in enumerate(zip(samples.prompt_ids, samples.response_ids, samples.texts, strict=True)):
                row = {"prompt_index": samples.prompt_index[k // per], "prompt_ids": p, "response_ids": r, "response": text,
                       "reward": rollout.scores.rewards[k].item(), "truncated": bool(samples.truncated[k])}
                if self.cfg.rollout.agent or self.cfg.rollout.tools:
                    row["action_mask"] = samples.response_mask[k, len(p) : len(p) + len(r)].tolist()
                f.write(json.dumps(row) + "\n")


class NoSignalError(RuntimeError):
    """RL steps in a row had no learning signal (every advantage 0): the run would return its input unchanged."""


def _reward_source(cfg: RLConfig) -> str:
    if cfg.rollout.agent:
        return f"rollout.agent={cfg.rollout.agent}"
    r = cfg.reward
    return f"reward.func={r.func}" if r.func else f"reward.url={r.url}" if r.url else f"reward.model={r.model}"


def main(argv: list[str] | None = None) -> None:
    print_result(SPEC, argv)


SPEC = StageSpec(
    STAGE, RLConfig, run_rl,
    (Input("policy", (POLICY,), field="base"), Input("reward_model", (REWARD,), field="reward.model"),
     Input("critic", (REWARD, POLICY), field="critic.model", needed=lambda config: StepPlan.of(config).values)),
    output=trained_output(POLICY, ADAPTER),
    files=("data.paths", "eval_data.paths", "reward.func", "eval_grader", "rollout.agent", "rollout.tools"),
    plugins=("reward.func", "eval_grader", "rollout.agent", "rollout.tools"),
    check=preflight,
    metrics=logged_metrics,
)

if __name__ == "__main__":
    main()
