"""The RL stage's config: rollout, algorithm, reward source, learners, Ray."""

from __future__ import annotations

import math
import urllib.parse
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from datasets_prep.loading import DataConfig
from stages.common.config import (
    PROMPT_DATA_UNUSED,
    ClusterConfig,
    LoggingConfig,
    LoraConfig,
    StageConfig,
    TrainConfig,
    section_unused,
)
from stages.common.identity import get_dotted
from stages.common.recipe import RecipeError
from stages.rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    lookup,
)


def endpoint_name(url: str) -> str:
    """``url`` as errors and logs may show it: scheme, host, port and path; no user, password or query."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{u.port}" if u.port else ""
    return f"{u.scheme}://{host}{port}{u.path or '/'}" + ("?..." if u.query else "")


def check_endpoint(url: str, timeout_s: float, retries: int) -> None:
    """What an HTTP reward source needs, checked before any work (raises ValueError naming the field)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"reward.url: {endpoint_name(url)!r} must be an http:// or https:// URL with a host")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"reward.timeout_s: {timeout_s} must be a positive number of seconds (the deadline of one call, retries included)")
    if retries < 0:
        raise ValueError(f"reward.retries: {retries} must be >= 0")


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    rollout_batch_size: int = Field(16, ge=1, description="prompts per RL step")
    n_samples_per_prompt: int = Field(4, ge=1, description="samples per prompt (a group, for the group-baseline estimators)")
    max_new_tokens: int = Field(16, ge=1, description="the longest response sampled")
    temperature: float = Field(1.0, description="sampling temperature: the learners and the reference divide their logits by it, so the policy trained on is the one sampled from (as OpenRLHF); vLLM reports the tempered log-probs for rollout_logprob_diff")
    top_p: float = Field(1.0, description="nucleus sampling: 1.0 only. Training on top-p samples would need the truncated distribution's log-probs on the learners too (not implemented), so other values are refused by name")
    num_engines: int = Field(1, ge=1, description="vLLM engines (each a Ray actor)")
    tensor_parallel_size: int = Field(1, ge=1, description="each engine's tensor-parallel workers (vLLM's multiprocess executor; on GPUs: that many GPUs of one node per engine, each worker loading its shard of every weight push)")
    enforce_eager: bool | None = Field(None, description="null: CUDA graphs on GPUs (vLLM's default), eager on CPU (the CPU build has no CUDA graphs); true: eager everywhere (less memory, slower decoding); false on CPU is refused")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="the share of each GPU an engine takes for weights and KV cache; null: 0.9 on GPUs of its own, 0.4 beside the learners (ray.colocate_all). GPU only")
    enable_sleep: bool = Field(False, description="OpenRLHF's --vllm_enable_sleep (hybrid engine): with ray.colocate_all on GPUs, each engine sleeps (vLLM sleep mode level 2: weights and KV cache freed) while the learners train and wakes before the next weight push, which reloads every weight anyway. Refused on CPU and with rollout.async")
    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="the vLLM engines' dtype")
    max_model_len: int = Field(512, ge=1, description="prompt + response tokens the engines hold")
    async_: bool = Field(False, alias="async", description="async training (OpenRLHF's async_enable): the engines generate the next max_staleness steps' samples while the learners train, each step's batch sampled by weights up to max_staleness updates old; the engine's log-probs are kept for the IS correction (algo.is_correction, which async runs should set)")
    max_staleness: int = Field(1, ge=1, description="async: how many updates behind the learners a batch's weights may be")
    agent: str | None = Field(None, description="multi-turn agents (stages.common.agents): a file (or module) defining OpenRLHF's AgentExecutor / AgentInstance classes, or reset(prompt, label) and step(state, action_text); its step rewards replace the reward source; every episode in flight at once, at most max_turns actions each")
    max_turns: int = Field(2, ge=1, description="an agent (or tools) episode's most actions")
    tools: str | None = Field(None, description="tool calling (stages.common.tools): a file (or module) of typed, documented functions (sync or async), rendered by the chat template; a call in an action is run and its answer appended as a tool message (out of the loss). Without an agent the episode ends at an answer with no call and the reward function scores it")
    tool_parser: str = Field("hermes", description="the tool-call format parsed from actions: hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, Qwen's), or one registered with stages.common.tools.register_parser")
    max_tool_calls: int = Field(4, ge=0, description="tool calls an episode may make; an action whose calls go beyond them ends the episode")
    env_timeout_s: float | None = Field(60.0, gt=0, description="the deadline of every environment call of an episode (reset, step, a tool): one that gives no answer fails the step naming the row and the turn; null: none")
    max_concurrent_episodes: int = Field(256, ge=1, description="agent episodes in flight at once on each engine (and the threads that run sync environment calls)")


class AlgoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    advantage_estimator: str = Field("group_norm", description="gae (PPO with a critic), reinforce (REINFORCE++), reinforce_baseline (REINFORCE++-baseline), rloo, group_norm (GRPO; TRL's 'grpo'), dr_grpo (Dr. GRPO)")
    policy_loss: str = Field("ppo", description="ppo (clipped token ratio) or gspo (sequence-level ratio)")
    clip_eps_low: float = Field(0.2, gt=0, description="the ratio's lower clip: 1 - clip_eps_low")
    clip_eps_high: float = Field(0.2, gt=0, description="the ratio's upper clip: 1 + clip_eps_high (DAPO's clip-higher when above clip_eps_low)")
    dual_clip: float | None = Field(None, gt=1, description="OpenRLHF: > 1")
    entropy_coef: float | None = Field(None, description="OpenRLHF's entropy_loss_coef: None or 0: the entropy is logged only; > 0: coef * entropy is subtracted from the loss (aggregated like the policy loss)")
    loss_agg: str = Field("token_mean", description="how token losses become a scalar: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm (Dr. GRPO)")
    ppo_epochs: int = Field(1, description="passes of updates over each step's samples")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of the per-token returns. OpenRLHF forces 1.0 for the group-baseline estimators (rloo, reinforce_baseline, group_norm, dr_grpo); here the value given is used as it is")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE's lambda (estimator gae)")
    init_kl_coef: float = Field(0.0, ge=0, description="0: no reference model at all")
    kl_estimator: str = Field("k1", description="k1, k2 or k3 (Schulman's estimators of KL to the reference)")
    kl_in_reward: bool = Field(True, description="True: -coef*KL per token in the reward; False: coef*KL as a loss term")
    kl_target: float | None = Field(None, gt=0, description="adaptive coefficient (Ziegler et al. 2019) when set")
    kl_horizon: int = Field(10000, ge=1, description="the adaptive KL controller's horizon (samples)")
    reward_clip: float | None = Field(None, gt=0, description="clip the sequence reward to [-c, c]. Differs from OpenRLHF on purpose: OpenRLHF clips the raw reward before the group baseline; here the clip applies to what the estimator passes on (the baselined reward for rloo / group_norm / dr_grpo / reinforce_baseline, the raw one for reinforce and gae)")
    normalize_reward: bool = Field(False, description="with a reward model: (r - mean) / std from its checkpoint")
    overlong_buffer: int | None = Field(None, ge=1, description="DAPO: penalise the last `buffer` tokens before max_new_tokens")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO: the penalty at max_new_tokens (falling linearly over the buffer)")
    stop_properly_penalty: float | None = Field(None, description="ProRL / OpenRLHF: responses that hit max_new_tokens without a stop token: a coef in [0, 1] scales their reward, a negative one replaces it (applied after the overlong penalty, before the advantages)")
    is_correction: str | None = Field(None, description="importance-sampling correction of the rollout engine's sampling log-probs against the learners' (OpenRLHF's is_correction_type): tis (clamp), icepop (drop tokens outside), seq-mask-tis (drop sequences whose geometric-mean ratio is outside); the ratio's [low, high]")
    is_threshold: tuple[float, float] = Field((0.5, 5.0), description="the IS ratio's [low, high] for is_correction")
    dynamic_filtering: tuple[float, float] | None = Field(None, description="DAPO's dynamic filtering: keep groups whose mean score lies strictly inside (low, high), drawing more prompts (at most dynamic_filtering_max_batches extra batches per step) until rollout_batch_size remain")
    dynamic_filtering_max_batches: int = Field(4, ge=1, description="extra prompt batches a step may draw to refill filtered groups")
    max_steps_without_signal: int = Field(10, ge=0, description="fail the stage after this many steps in a row with no learning signal (the group-baseline estimators: every group's rewards equal; the others: every reward of the step equal; then every advantage is 0 and the policy does not move); 0: never fail (such steps are still logged, no_signal 1, and warned about)")

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        for name, registry, value in (
            ("advantage_estimator", ADVANTAGE_ESTIMATORS, self.advantage_estimator),
            ("policy_loss", POLICY_LOSSES, self.policy_loss),
            ("kl_estimator", KL_ESTIMATORS, self.kl_estimator),
            ("is_correction", IS_CORRECTIONS, self.is_correction),
        ):
            if value is not None:
                lookup(registry, value, name)
        if self.loss_agg not in AGGREGATIONS:
            raise ValueError(f"loss_agg: '{self.loss_agg}' is unknown; valid: {', '.join(AGGREGATIONS)}")
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs: {self.ppo_epochs} must be at least 1")
        if self.entropy_coef is not None and self.entropy_coef < 0:
            raise ValueError(f"entropy_coef: {self.entropy_coef} must be >= 0 (or null: entropy logged only)")
        if self.stop_properly_penalty is not None and self.stop_properly_penalty > 1:
            raise ValueError(f"stop_properly_penalty: {self.stop_properly_penalty} must be in [0, 1] (scales a truncated "
                             "response's reward) or negative (replaces it)")
        low, high = self.is_threshold
        if not 0 <= low < high:
            raise ValueError(f"is_threshold: [{low}, {high}] must satisfy 0 <= low < high")
        if self.dynamic_filtering is not None and not self.dynamic_filtering[0] < self.dynamic_filtering[1]:
            raise ValueError(f"dynamic_filtering: ({self.dynamic_filtering[0]}, {self.dynamic_filtering[1]}) must be (low, high) "
                             "with low < high")
        return self


class RewardSourceConfig(BaseModel):
    """Exactly one of: a Python file with ``reward_func``, an HTTP endpoint, a reward-model checkpoint."""

    model_config = ConfigDict(extra="forbid")

    func: str | None = Field(None, description="file.py (its reward_func), file.py:name or module:name")
    check_call: bool = Field(True, description="at planning, call func once on two held-out (else training) rows with an empty response: its answer's shape and extra_logs names are checked before anything starts")
    url: str | list[str] | None = Field(None, description="one endpoint, or several: each call's samples are split into one contiguous batch per endpoint, sent at once")
    protocol: Literal["openrlhf", "queries"] = Field("openrlhf", description="openrlhf: POST {\"query\", \"prompts\", \"labels\"} (OpenRLHF's remote reward servers and serve_rm); queries: POST {\"queries\", \"prompts\", \"labels\"}. Both answer {\"rewards\", \"scores\"?, \"extra_logs\"?}")
    token_env: str | None = Field(None, description="the environment variable holding a token sent as \"Authorization: Bearer <token>\" (never logged)")
    model: str | None = Field(None, description="from the CLI; flows pass the reward model's reference")
    timeout_s: float = Field(30.0, description="the deadline of one reward call: connect, send, read and every retry")
    retries: int = Field(3, description="more attempts after a transport error, 5xx, 408 or 429 (never after another 4xx)")

    @model_validator(mode="after")
    def _check(self) -> RewardSourceConfig:
        urls = [self.url] if isinstance(self.url, str) else self.url
        if urls is not None and not urls:
            raise ValueError("reward.url: an empty list; give one endpoint or several")
        for u in urls or ["http://unset"]:
            check_endpoint(u, self.timeout_s, self.retries)
        return self

    @property
    def urls(self) -> list[str]:
        return [self.url] if isinstance(self.url, str) else list(self.url or [])


class CriticConfig(BaseModel):
    """PPO's critic (estimator ``gae``): a per-token value head (``score``) on a transformer, trained by its
    own DeepSpeed learners (``train.world_size`` ranks, the policy's ZeRO stage, dtype and micro-batch)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="where the critic starts, from the CLI; flows pass a checkpoint (the pipeline's `critic` input). Unset: the reward model input when there is one (as OpenRLHF), else the starting policy")
    lr: float = Field(9e-6, description="OpenRLHF's critic_learning_rate default")
    value_clip: float | None = Field(0.5, description="clipped value loss max((clip(V) - R)^2, (V - R)^2) / 2 with V clipped to V_old +- value_clip; null: unclipped")
    freezing_steps: int = Field(0, description="the first N steps train the critic only (the policy and the engines stay as they are)")

    @model_validator(mode="after")
    def _check(self) -> CriticConfig:
        if self.lr <= 0:
            raise ValueError(f"lr: {self.lr} must be positive")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip: {self.value_clip} must be positive (or null: no clip)")
        if self.freezing_steps < 0:
            raise ValueError(f"freezing_steps: {self.freezing_steps} must be >= 0")
        return self


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_cpus: int | None = Field(None, ge=1, description="the private local cluster's CPUs (default: this machine's)")
    colocate_all: bool = Field(False, description="GPU: vLLM engines share the learners' GPUs (fractional GPU per actor) instead of their own. On CPU, engines never reserve CPUs (they run while the learners wait), so this changes nothing.")
    call_timeout_s: float = Field(3600.0, gt=0, description="the deadline of every call the driver waits on (a rollout, an update, a weight push, a save): an actor that does not answer in time is named and the stage fails instead of hanging")
    startup_timeout_s: float = Field(3600.0, gt=0, description="the deadline of starting up: the placement group, every actor's model load and DeepSpeed set-up, the engines' start (a large model's load can take far longer than any step's call)")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "address" in data:
            raise ValueError(f"ray.address: {data['address']!r}: the cluster's address is cluster.address now (one "
                             "setting for every training stage)")
        return data


class SyncConfig(BaseModel):
    """How the learners' weights reach the engines after every update (``stages.rl.weight_sync``)."""

    model_config = ConfigDict(extra="forbid")

    transport: Literal["broadcast", "object_store"] = Field("broadcast", description="broadcast: learner rank 0 and every engine worker form one process group and the weights are broadcast tensor by tensor (ZeRO-3 gathered one module at a time), each worker loading them as they arrive; object_store: rank 0 puts the whole state dict in Ray's object store as safetensors bytes and every engine loads it (for engines that can't join a group)")
    bucket_mb: float = Field(256.0, gt=0, description="broadcast: the weights travel in buckets of at most this many MiB (one collective per bucket; a larger tensor alone), copied in as each module is gathered; the receivers hold one bucket at a time")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="the broadcast's process-group backend (OpenRLHF's vllm_sync_backend): auto is NCCL on GPUs, gloo on CPU; gloo on GPUs sends through host memory")


class RLTrainConfig(TrainConfig):
    """The learners' settings: the shared ones, plus micro-batches sized by tokens (OpenRLHF's dynamic batch)."""

    enable_sleep: bool = Field(False, description="OpenRLHF's --deepspeed_enable_sleep (hybrid engine): with ray.colocate_all on GPUs and ZeRO-3, each learner moves its parameters and optimizer states to host memory while the engines generate and back before training. Refused on CPU (they are in host memory already)")

    max_tokens_per_micro_batch: int | None = Field(None, ge=1, description="when set: each rank's share of an optimizer step is sorted by length and cut into micro-batches of at most this many positions (rows x the longest row, the padded size a forward computes), instead of micro_train_batch_size rows; every rank runs the same number of micro-batches (ZeRO-3 forwards are collective). On a 2-core CPU ~2-4k positions keep the activations in cache (bench/rl_step.py)")


class RLConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")
    UNUSED: ClassVar[dict[str, str]] = {**section_unused("data", PROMPT_DATA_UNUSED), **section_unused("eval_data", PROMPT_DATA_UNUSED),
              "train.max_steps": "RL steps are max_steps (top level)",
              "train.num_epochs": "each step's samples are trained on algo.ppo_epochs times",
              "train.logging_steps": "RL logs every step",
              "train.timeout_s": "RL's deadlines are ray.call_timeout_s (each call) and ray.startup_timeout_s"}

    base: str = Field("tiny:tiny", description="the starting policy, from the CLI; flows pass the SFT checkpoint")
    data: DataConfig = Field(description="the training prompts (with labels for a reward function or agent)")
    eval_data: DataConfig | None = Field(None, description="held-out prompts: greedy accuracy (or mean reward) at step 0, every eval_steps and after the last step")
    eval_steps: int = Field(0, ge=0, description="greedy held-out accuracy every N steps (and before the first, as step 0, and with the last); 0 = those two only")
    eval_grader: str | None = Field(None, description="what grades the held-out responses (stages.common.graders: a built-in name, module:function or file.py); unset: the reward source's scores (a reward model: its mean score)")
    rollout: RolloutConfig = Field(RolloutConfig(), description="sampling: batch, group size, lengths, the vLLM engines, async, agents")
    algo: AlgoConfig = Field(AlgoConfig(), description="advantage estimator, policy loss, KL, shaping, IS correction, filtering")
    reward: RewardSourceConfig = Field(RewardSourceConfig(), description="where rewards come from: a function (reward.func), an HTTP server (reward.url) or a reward model")
    train: RLTrainConfig = Field(RLTrainConfig(zero_stage=3, train_batch_size=64, micro_train_batch_size=16, lr=1e-5), description="learners: world_size ranks, zero_stage, micro_train_batch_size (sequences per forward) or max_tokens_per_micro_batch, train_batch_size (sequences per optimizer step; divides rollout_batch_size x n_samples)")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters on the policy learners (the engines receive the merged weights)")
    critic: CriticConfig = Field(CriticConfig(), description="PPO's critic (estimator gae)")
    ray: RayConfig = Field(RayConfig(), description="the private Ray cluster's size and the driver's deadlines")
    cluster: ClusterConfig = Field(ClusterConfig(), description="cluster.address: join an existing Ray cluster instead of a private one")
    logging: LoggingConfig = Field(LoggingConfig(), description="logging.wandb: {project, ...}")
    max_steps: int = Field(10, ge=1, description="RL steps (rollout + update + sync)")
    log_rollouts_every: int = Field(0, ge=0, description="write a step's samples to rollouts/step_N.jsonl every N steps; 0 = never")
    sync: SyncConfig = Field(SyncConfig(), description="how weights reach the engines: a process-group broadcast (default) or Ray's object store")
    verify_sync: bool = Field(True, description="check every weight push on a fixed probe (vLLM's log-probs against the learner's)")
    sync_tolerance: float = Field(0.05, gt=0, description="mean |log-prob difference| vLLM vs learner on the probe (bf16 vLLM)")
    sync_min_prob: float = Field(1e-3, ge=0, lt=1, description="only probe tokens the learner gives at least this probability count (bf16 rounding moves the unlikely ones most)")
    seed: int = Field(0, description="sampling and prompt order")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")

    @model_validator(mode="after")
    def _check_sampling(self) -> RLConfig:
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if samples % self.train.train_batch_size:
            raise ValueError(
                f"train.train_batch_size: {self.train.train_batch_size} does not divide the {samples} samples of a "
                f"step (rollout_batch_size {self.rollout.rollout_batch_size} x n_samples_per_prompt {self.rollout.n_samples_per_prompt})"
            )
        if not self.rollout.temperature > 0:
            raise ValueError(f"rollout.temperature: got {self.rollout.temperature}, expected > 0 (0 is greedy decoding: "
                             "no exploration, and no sampling distribution to train on)")
        if self.rollout.top_p != 1.0:
            raise ValueError(
                f"rollout.top_p: got {self.rollout.top_p}, expected 1.0: the learners compute log-probs of the whole "
                "(tempered) distribution, so top-p samples would be trained on as if drawn from one they were not drawn from"
            )
        return self

    @model_validator(mode="after")
    def _check_hybrid_engine(self) -> RLConfig:
        """What sleeping engines and learners ask of the rest (the device is checked when the cluster is known)."""
        if self.rollout.enable_sleep:
            if not self.ray.colocate_all:
                raise ValueError("rollout.enable_sleep: sleeping engines free GPU memory for learners on the same GPUs; "
                                 "set ray.colocate_all: true (engines on GPUs of their own have nothing to hand over)")
            if self.rollout.async_:
                raise ValueError("rollout.enable_sleep: async engines generate while the learners train, so they can't "
                                 "sleep then; set rollout.async: false or rollout.enable_sleep: false")
        if self.train.enable_sleep:
            if not self.ray.colocate_all:
                raise ValueError("train.enable_sleep: learners hand their GPU memory to engines on the same GPUs; set "
                                 "ray.colocate_all: true")
            if self.train.zero_stage != 3:
                raise ValueError(f"train.enable_sleep: DeepSpeed offloads a ZeRO-3 engine's states only; zero_stage is "
                                 f"{self.train.zero_stage}")
        return self

    def check_device(self, gpu: bool) -> None:
        """The GPU-only settings, refused by name when the run's actors are on CPUs (``gpu`` false)."""
        if gpu:
            return
        why = {
            "rollout.enable_sleep": (self.rollout.enable_sleep, "vLLM's sleep mode exists on CUDA GPUs only"),
            "train.enable_sleep": (self.train.enable_sleep, "the learners' states are in host memory already"),
            "rollout.enforce_eager": (self.rollout.enforce_eager is False, "CUDA graphs exist on GPUs only; the CPU build runs eager"),
            "rollout.gpu_memory_utilization": (self.rollout.gpu_memory_utilization is not None, "the CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE (GiB)"),
            "sync.backend": (self.sync.backend == "nccl", "NCCL needs GPUs; on CPU the broadcast uses gloo"),
        }
        for field, (asked, reason) in why.items():
            if asked:
                raise RecipeError(f"{field}: {get_dotted(self, field)!r} is a GPU setting and this run's actors are on CPUs "
                                 f"(cluster.gpu={self.cluster.gpu}): {reason}. Remove it, or run on GPUs")

    def sync_backend(self, gpu: bool) -> str:
        return ("nccl" if gpu else "gloo") if self.sync.backend == "auto" else self.sync.backend

    @model_validator(mode="after")
    def _check_reward_source(self) -> RLConfig:
        sources = [k for k in ("func", "url", "model") if getattr(self.reward, k)]
        if len(sources) > 1:
            raise ValueError(f"reward: give one of func, url, model (got {', '.join(sources)})")
        if self.rollout.agent:
            if sources:
                raise ValueError(f"reward.{sources[0]}: rollout.agent's step gives the rewards; remove reward.{sources[0]} "
                                 "(or rollout.agent)")
            if self.eval_grader:
                raise ValueError("eval_grader: rollout.agent scores the held-out episodes itself; remove eval_grader")
        if self.rollout.tools and not self.rollout.agent:
            if not sources:
                raise ValueError("rollout.tools: without rollout.agent an episode is scored by the reward source; set "
                                 "reward.func, reward.url or reward.model (or rollout.agent)")
        return self

    @model_validator(mode="after")
    def _check_algorithm(self) -> RLConfig:
        """What the estimator's traits ask of the rest of the config."""
        estimator = ADVANTAGE_ESTIMATORS[self.algo.advantage_estimator]
        if estimator.needs_critic and self.critic.freezing_steps >= self.max_steps:
            raise ValueError(f"critic.freezing_steps: {self.critic.freezing_steps} leaves no step of the {self.max_steps} "
                             "(max_steps) to train the policy in")
        if self.rollout.n_samples_per_prompt < estimator.min_group:
            raise ValueError(f"rollout.n_samples_per_prompt: {self.algo.advantage_estimator} needs at least "
                             f"{estimator.min_group} samples per prompt")
        if self.algo.dynamic_filtering is not None and self.rollout.n_samples_per_prompt < 2:
            raise ValueError("rollout.n_samples_per_prompt: algo.dynamic_filtering filters groups by their mean score and "
                             f"needs at least 2 samples per prompt (got {self.rollout.n_samples_per_prompt})")
        return self
