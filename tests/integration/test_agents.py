"""Agent episodes on a real vLLM engine: every episode in flight at once, OpenRLHF's agent classes and their
reward semantics, a hung environment's deadline, tool calls (a malformed call and a raising tool included), and
an OpenRLHF-shaped agent training with async RL (every weight push verified)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from stages.common.episodes import Job
from stages.common.errors import StageFailed
from stages.common.launcher import launch

pytestmark = pytest.mark.integration

AGENTS = Path(__file__).resolve().parents[1] / "agents"
DATA = {"paths": ["unused.jsonl"], "prompt_key": "prompt", "label_key": "answer", "apply_chat_template": True}


def _spec(**over) -> dict:
    spec = dict(agent=None, tools=None, tool_parser="hermes", max_tool_calls=4, max_turns=3, max_new_tokens=6,
                max_model_len=256, temperature=1.0, logprobs=True, env_timeout_s=30.0, max_concurrent=256, data=DATA)
    return {**spec, **over}


def _jobs(tokenizer, rows: list[tuple[str, str]], n: int, seed: int = 11, tools: list | None = None) -> list[dict]:
    from stages.common.generation import request_seed

    render = lambda p: tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,  # noqa: E731
                                                     add_generation_prompt=True, tools=tools)
    return [asdict(Job(r + 1, render(p), p, a, request_seed(seed, r * n + j))) for r, (p, a) in enumerate(rows) for j in range(n)]


def _spans(ep: dict) -> list[list[int]]:
    """An episode's actions: the runs of its tokens in the loss."""
    spans, cur = [], []
    for t, m in zip(ep["token_ids"], ep["action_mask"], strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_openrlhf_agent_episodes_in_flight_sum_their_rewards_and_repeat_whatever_order_they_finish_in(micro_sft, tokenizer, tmp_path):
    rows = [("7+8", "15"), ("12+30", "42"), ("1+1", "2"), ("50+50", "100")]
    jobs = _jobs(tokenizer, rows, n=4)
    spec = _spec(agent=str(AGENTS / "openrlhf_shape.py"))
    out = launch("stages.common.episodes:episodes_rank", {"model": micro_sft.path, "runs": [{"jobs": jobs, "spec": spec}] * 2},
                 1, tmp_path)
    first, second = (r["episodes"] for r in out["runs"])
    # each action samples with its own seed: the same episodes whatever order the random sleeps finished them in
    assert [e["token_ids"] for e in first] == [e["token_ids"] for e in second]
    feedback = tokenizer("<|user|>again<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    rewards = []
    for job, ep in zip(jobs, first, strict=True):
        assert ep["prompt_ids"] == tokenizer(job["prompt"], add_special_tokens=False)["input_ids"]
        actions = _spans(ep)
        assert ep["turns"] == len(actions) == 3
        # between the actions: exactly the feedback's tokens, out of the loss, log-prob 0; none after the last
        env = [t for t, m in zip(ep["token_ids"], ep["action_mask"], strict=True) if not m]
        assert env == feedback * 2 and ep["action_mask"][-1] == 1
        assert all(lp == 0.0 for lp, m in zip(ep["logprobs"], ep["action_mask"], strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(ep["logprobs"], ep["action_mask"], strict=True) if m)
        hits = [tokenizer.decode(a, skip_special_tokens=True).startswith("1") for a in actions]
        assert ep["reward"] == sum(turn * h for turn, h in enumerate(hits, 1))  # OpenRLHF: the sum of the steps' rewards
        assert ep["score"] == float(hits[-1])  # the last step's scores
        assert ep["info"] == {"hits": float(sum(hits))}  # the last step's extra_logs
        rewards.append(ep["reward"])
    assert len(set(rewards)) > 1  # the toy rewards vary, so the hand computation above checked something
    # one engine step serves many episodes' actions at once (continuous batching), not one episode at a time
    assert out["runs"][0]["engine_steps"] < 3 * len(jobs) * 6 / 4


def test_a_hung_environment_fails_the_episodes_at_its_deadline_naming_the_row_and_step(micro_sft, tokenizer, tmp_path):
    import time

    jobs = _jobs(tokenizer, [("4+5", "8"), ("4+5", "9")], n=2)
    spec = _spec(agent=str(AGENTS / "hangs.py"), env_timeout_s=2.0)
    t = time.monotonic()
    with pytest.raises(StageFailed, match=r"rollout.agent .*hangs.py: row 2: step 1 gave no answer within 2 s \(rollout.env_timeout_s\)"):
        launch("stages.common.episodes:episodes_rank", {"model": micro_sft.path, "runs": [{"jobs": jobs, "spec": spec}]}, 1, tmp_path)
    assert time.monotonic() - t < 120  # the engine's start-up, then the deadline; not the hour the environment sleeps


def test_tool_calls_are_parsed_answered_and_counted_with_a_malformed_call_and_a_raising_tool(micro_sft, tokenizer, tmp_path):
    from stages.common.agents import continuation
    from stages.common.tools import load_tools

    tools = load_tools(str(AGENTS / "faulty_tools.py"))
    jobs = _jobs(tokenizer, [("7+8", "15"), ("2+2", "4")], n=2, tools=tools.schemas)
    spec = _spec(tools=str(AGENTS / "faulty_tools.py"), tool_parser="scripted", max_tool_calls=3)
    out = launch("stages.common.episodes:episodes_rank", {"model": micro_sft.path, "runs": [{"jobs": jobs, "spec": spec}]}, 1, tmp_path)
    answers = continuation(tokenizer, [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "unknown", "content": "Error: the tool call is not JSON (Expecting property name enclosed in double quotes at character 1): {not json}"},
        {"role": "tool", "name": "boom", "content": "Error: RuntimeError: the tool broke"}])
    for ep in out["runs"][0]["episodes"]:
        # the first action's three calls answered as tool messages; the second action's would exceed max_tool_calls
        assert ep["turns"] == 2 and ep["reward"] is None  # no agent: the reward function scores it
        env = [t for t, m in zip(ep["token_ids"], ep["action_mask"], strict=True) if not m]
        assert tokenizer.decode(env) == answers
        assert ep["info"] == {"tool_calls": 3.0, "tool_failures": 2.0, "tool_calls_add": 1.0, "tool_calls_boom": 1.0,
                              "tool_failures_add": 0.0, "tool_failures_boom": 1.0}


def test_an_openrlhf_agent_trains_with_async_rl_and_every_push_verified(task_files, micro_sft, tokenizer, tmp_path):
    from stages.rl.driver import run_rl
    from tests.conftest import metrics
    from tests.integration.test_rl import _config

    cfg = _config(task_files, tmp_path, None, "max_steps=2", "train.world_size=1", "train.zero_stage=2",
                  "rollout.n_samples_per_prompt=4", "train.train_batch_size=32", "train.micro_train_batch_size=32",
                  "algo.advantage_estimator=reinforce_baseline", "rollout.async=true", "algo.is_correction=tis",
                  f"rollout.agent={AGENTS / 'openrlhf_shape.py'}", "rollout.max_turns=3", "log_rollouts_every=1", reward={})
    ref = run_rl(cfg, micro_sft)
    steps = metrics(ref)
    assert len(steps) == 2 and all(s["turns"] == 3.0 for s in steps)
    assert all(s["sync_logprob_diff"] <= 1e-3 for s in steps), [s["sync_logprob_diff"] for s in steps]
    for step in (1, 2):
        rows = [json.loads(ln) for ln in (Path(ref.path).parent / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        for row in rows:
            ep = {"token_ids": row["response_ids"], "action_mask": row["action_mask"]}
            hits = [tokenizer.decode(a, skip_special_tokens=True).startswith("1") for a in _spans(ep)]
            assert row["reward"] == sum(turn * h for turn, h in enumerate(hits, 1))
        mean_hits = sum(sum(tokenizer.decode(a, skip_special_tokens=True).startswith("1")
                            for a in _spans({"token_ids": r["response_ids"], "action_mask": r["action_mask"]})) for r in rows) / len(rows)
        assert steps[step - 1]["hits"] == pytest.approx(mean_hits)


def test_the_eval_stage_runs_the_agent_and_the_tools_on_held_out_rows_and_reports_their_metrics(task_files, micro_sft, tmp_path):
    from stages.eval import EvalConfig, run_eval

    common = {"data": {"paths": [str(task_files["eval"])], "prompt_key": "prompt", "label_key": "answer", "max_samples": 8},
              "max_new_tokens": 6, "num_samples": 2, "pass_k": 2, "max_turns": 3, "max_model_len": 256}
    agent = run_eval(EvalConfig.model_validate({**common, "agent": str(AGENTS / "openrlhf_shape.py"),
                                                "output_root": str(tmp_path / "a")}), {"sft": micro_sft})
    row = agent.metrics["sft"]
    assert row["n"] == 8 and row["turns"] == 3.0 and row["tool_calls"] is None
    assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["episode_reward"] <= 6.0  # 1 + 2 + 3 at most
    assert "| sft |" in Path(agent.markdown).read_text() and "episode_reward" in Path(agent.markdown).read_text()
    tools = run_eval(EvalConfig.model_validate({**common, "tools": str(AGENTS / "faulty_tools.py"), "tool_parser": "scripted",
                                                "max_tool_calls": 3, "output_root": str(tmp_path / "t")}), {"sft": micro_sft})
    row = tools.metrics["sft"]
    assert (row["turns"], row["tool_calls"], row["tool_failures"]) == (2.0, 3.0, 2.0)
    assert "tool_failures" in Path(tools.markdown).read_text()


def test_tools_only_rl_scores_episodes_with_the_reward_function_and_logs_their_calls(task_files, micro_sft, tokenizer, tmp_path):
    """No agent: the reward function scores each episode's decoded text (its special tokens kept, so the turns stay
    apart), and the tools' counts are logged beside the function's own metrics, all declared at planning."""
    from stages.rl.driver import run_rl
    from stages.rl.preflight import logged_metrics
    from tests.conftest import metrics
    from tests.integration.test_rl import _config

    reward = tmp_path / "count_tool_turns.py"
    reward.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    r = [float(q[len(p):].count('<|tool|>')) for q, p in zip(queries, prompts)]\n"
        "    return {'rewards': r, 'extra_logs': {'tool_turns': r}}\n")
    cfg = _config(task_files, tmp_path, reward, "max_steps=1", "train.world_size=1", "train.zero_stage=2",
                  "rollout.n_samples_per_prompt=4", "train.train_batch_size=32", "train.micro_train_batch_size=32",
                  f"rollout.tools={AGENTS / 'faulty_tools.py'}", "rollout.tool_parser=scripted", "rollout.max_tool_calls=3",
                  "rollout.max_turns=3", "log_rollouts_every=1")
    declared = logged_metrics(cfg)
    assert {"tool_calls", "tool_failures_boom", "turns", "tool_turns"} <= declared.names and declared.open is None
    ref = run_rl(cfg, micro_sft)
    (step,) = metrics(ref)
    assert (step["tool_calls"], step["tool_failures"], step["turns"]) == (3.0, 2.0, 2.0)
    assert step["tool_turns"] == step["reward_mean"] == 3.0  # three tool messages, each seen by the reward function
