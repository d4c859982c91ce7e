"""What the RL stage checks before any process starts, and the metrics it declares (a pipeline's plan runs both).

- The reward function, agent and held-out grader import; every reward server accepts connections.
- A reward function is called once (``reward.check_call``, on by default) on two rows of the held-out prompts (else
  the training prompts; local files only: no download at planning) with an empty response: a result of the wrong shape fails at planning, not after Ray and
  vLLM started, and the names of its ``extra_logs`` become metrics a gate may name.
- :func:`check_inputs` (when the stage starts): the input checkpoints verify and are of the kinds they are used as.
- :func:`logged_metrics`: every metric a step, the held-out eval and the manifest can hold (``stages.rl.metrics``,
  the learners', the critic's, the sampler's, the phase timings), for gates and ``train.save_best`` to be checked
  against. An agent's info and an endpoint's ``extra_logs`` are known only to the run (``Logged.open``).
"""

from __future__ import annotations

from typing import Any

from checkpoints import CheckpointRef, require_kind, verify
from stages.common.stage import Logged, logged
from stages.rl.config import RLConfig

# stages.rl.metrics.step_metrics (rollout_logprob_diff with rollout log-probs), signal_metrics and PhaseTimer's phases
STEP = ("reward_mean", "reward_std", "shaped_reward_mean", "accuracy", "kl", "kl_coef", "response_length", "truncated_share",
        "sync_logprob_diff", "sync_max_logprob_diff", "rollout_logprob_diff", "generated_tokens_per_s",
        "zero_std_share", "zero_advantage_share", "no_signal",
        "generate_s", "reference_s", "reward_s", "train_s", "sync_s", "total_s")
# stages.rl.actors.Trainers.update: the learners' (vllm_kl with an importance-sampling correction), the critic's
UPDATES = ("policy_loss", "clip_ratio", "entropy", "grad_norm", "lr", "vllm_kl", "policy_frozen")
CRITIC = ("critic_loss", "value_mean", "critic_clip_ratio", "critic_grad_norm", "critic_lr", "return_mean")
FILTERING = ("filtered_share", "prompts_drawn")  # stages.rl.sampler's dynamic filtering


def plugins(config: RLConfig):
    """The agent, the held-out grader and the tools the config names (a bad reference fails here, before Ray
    starts): ``(agent, grader, tools)``."""
    agent = grader = tools = None
    if config.rollout.agent:
        from stages.common.agents import load_agent

        agent = load_agent(config.rollout.agent)
    if config.eval_grader:
        from stages.common.graders import load_grader

        grader = load_grader(config.eval_grader)
    if config.rollout.tools:
        from stages.common.tools import PARSERS, ToolError, load_tools

        tools = load_tools(config.rollout.tools)  # (a file may register its own parser)
        if config.rollout.tool_parser not in PARSERS:
            raise ToolError(f"rollout.tool_parser: {config.rollout.tool_parser!r} is not a tool-call parser; known: "
                            f"{', '.join(sorted(PARSERS))} (stages.common.tools.register_parser adds one)")
    return agent, grader, tools


def check_inputs(config: RLConfig, plan, policy: CheckpointRef, reward_model: CheckpointRef | None,
                  critic: CheckpointRef | None) -> CheckpointRef | None:
    """Verify the inputs and their kinds; the critic's starting checkpoint (None without a critic)."""
    for field, given, value in (("reward.model", reward_model, config.reward.model),
                                ("critic.model", critic if plan.values else True, config.critic.model)):
        if value and given is None:
            raise ValueError(f"{field}: {value!r} is named but no checkpoint was passed for it: run_rl takes it as an "
                             "argument (the stage's CLI and the flows resolve the field into one)")
    verify(policy)
    require_kind(policy, ("full",), "the RL policy")
    if reward_model is not None:
        verify(reward_model)
        require_kind(reward_model, ("reward",), "the RL reward model")
    if not plan.values:
        return None
    if critic is not None:
        verify(critic)
    start = critic or reward_model or policy
    require_kind(start, ("full", "reward"), "the critic's starting model")
    return start


def preflight(config: RLConfig) -> None:
    """Before any process starts: the reward function, agent and grader import (the function answers a dry call in
    a shape it may), and every reward server accepts connections."""
    from stages.rl.rewards import check_reachable, text_reward

    if config.reward.func and not config.rollout.agent:
        reward = text_reward(config)
        if dry_callable(config):
            dry_call(config, reward)
    plugins(config)
    for url in config.reward.urls:
        check_reachable(url, min(config.reward.timeout_s, 5.0))


def dry_callable(config: RLConfig) -> bool:
    """A dry call is made when ``reward.check_call`` is on and its rows are local files (a hub dataset is not
    downloaded at planning)."""
    import os

    data = config.eval_data or config.data
    return bool(config.reward.func and not config.rollout.agent and config.reward.check_call
                and all(os.path.exists(p) for p in data.paths))


def _dry_rows(config: RLConfig) -> tuple[list[str], list[Any]]:
    from datasets_prep.loading import check_prompt_label_row, load_rows

    data = config.eval_data or config.data
    rows = load_rows(data, check_prompt_label_row(data))[:2]
    prompts = [r[data.prompt_key] if isinstance(r[data.prompt_key], str) else str(r[data.prompt_key][-1]["content"]) for r in rows]
    return prompts, [r[data.label_key] for r in rows]


def dry_call(config: RLConfig, reward) -> dict[str, Any]:
    """The reward function's answer on two rows with an empty response, checked as a step checks it (RewardError
    naming the function and saying which shapes are accepted), once per function, its code and its rows."""
    from stages.common.identity import plugin_digest
    from stages.common.plugins import source_file

    src = source_file(config.reward.func)  # an edited function (or a helper of it) is called again
    key = (config.reward.func, plugin_digest(src) if src else "", str(config.eval_data or config.data))
    if key not in _DRY:
        prompts, labels = _dry_rows(config)
        _DRY[key] = reward(list(prompts), prompts, labels)
    return _DRY[key]


_DRY: dict[tuple, dict[str, Any]] = {}


def logged_metrics(config: RLConfig) -> Logged:
    """Every metric a run of ``config`` can log (see the module docstring)."""
    from stages.rl.experience import StepPlan

    extra: list[str] = []
    held_out = ["eval_accuracy"]
    open_ = None
    episode: list[str] = []
    if config.rollout.agent or config.rollout.tools:
        from stages.common.tools import load_tools, tool_metrics

        episode = ["turns", *(tool_metrics(load_tools(config.rollout.tools).names) if config.rollout.tools else [])]
        held_out += [f"eval_{k}" for k in episode]
    if config.rollout.agent:
        extra, open_ = episode, "the agent's extra_logs (each episode's last step's)"
    elif dry_callable(config):
        from stages.rl.rewards import text_reward

        extra = list(dry_call(config, text_reward(config))["extra_logs"])
    elif config.reward.func:
        open_ = "the reward function's extra_logs (no dry call: reward.check_call is off, or its rows are not local)"
    elif config.reward.url:
        open_ = "the reward endpoint's extra_logs"
    elif not config.eval_grader:
        held_out = ["eval_reward"]  # a reward model scores the held-out prompts
    if not config.rollout.agent:  # tools-only episodes: the reward source's metrics and the episodes'
        extra = [*extra, *episode]
    critic = CRITIC if StepPlan.of(config).values else ()
    return logged(STEP, UPDATES, critic, FILTERING, extra, held_out, "step", "value", open=open_)
