"""Multi-turn agent trajectories: the model's tokens kept exactly as sampled, the environment's appended as
tokens and masked out of the loss; the built-in two-attempt agent's rewards; bad agents named before any work."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stages.common.agents import (
    AgentError,
    check_step_answer,
    check_step_result,
    episode_of,
    feedback_ids,
    load_agent,
)
from stages.common.generation import Completion
from stages.rl.config import RLConfig
from stages.rl.experience import Samples

RETRY = {"role": "user", "content": "wrong, try again"}
AGENTS = Path(__file__).resolve().parents[1] / "agents"


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _action(tok, prompt: list[int], text: str, logprobs: list[float] | None = None) -> Completion:
    ids = _ids(tok, text) + [tok.eos_token_id]  # as vLLM returns a stopped completion: the stop token included
    return Completion(prompt, ids, text, logprobs or [-0.5] * len(ids), "stop")


def test_an_episode_dict_becomes_the_sampled_tokens_and_the_chat_rendered_observation_with_the_loss_on_actions_only(tokenizer):
    """OpenRLHF's episode dict (observation_tokens, action_ranges, rollout_log_probs) as the learner's sample."""
    tok = tokenizer
    prompt = _ids(tok, tok.apply_chat_template([{"role": "user", "content": "7+8"}], add_generation_prompt=True, tokenize=False))
    first, second = _action(tok, prompt, "14"), _action(tok, prompt, "15")
    obs = feedback_ids(tok, RETRY, "test")
    ids = prompt + first.token_ids + obs + second.token_ids
    a, b = len(prompt), len(prompt) + len(first.token_ids)
    ranges = [(a, b), (b + len(obs), len(ids))]
    logps = [0.0] * a + [-0.1, -0.2, -0.3] + [0.0] * len(obs) + [-0.4, -0.5, -0.6]
    result = {"observation_tokens": ids, "action_ranges": ranges, "rollout_log_probs": logps, "reward": torch.tensor(0.5),
              "scores": [1.0], "extra_logs": {"second_attempt_success": torch.tensor(1)}, "finish_reason": "stop"}
    episode = episode_of(result, tok, with_logprobs=True, where="test")
    # bit for bit: the sampled ids, then the observation's, then the sampled ids again
    assert episode.prompt_ids == prompt and episode.token_ids == first.token_ids + obs + second.token_ids
    assert episode.action_mask == [1] * 3 + [0] * len(obs) + [1] * 3
    assert episode.logprobs == [-0.1, -0.2, -0.3] + [0.0] * len(obs) + [-0.4, -0.5, -0.6]
    # the same text the chat template renders for the whole conversation
    conversation = [{"role": "user", "content": "7+8"}, {"role": "assistant", "content": "14"}, RETRY,
                    {"role": "assistant", "content": "15"}]
    assert tok.decode(prompt + episode.token_ids) == tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(obs) == "<|user|>wrong, try again<|end|><|assistant|>"
    # a string observation is appended as it is
    assert feedback_ids(tok, "Try: 12", "test") == _ids(tok, "Try: 12")
    # tensors and one-element lists are numbers, as OpenRLHF takes them
    assert (episode.reward, episode.score, episode.turns, episode.info) == (0.5, 1.0, 2, {"second_attempt_success": 1.0})
    other = Completion(list(prompt), [tok.eos_token_id], "", [-2.0], "stop")  # a one-token single-turn sample
    s = Samples.of([0], [[episode, other]], tok.pad_token_id, with_logp=True)
    p, r = len(prompt), len(episode.token_ids)
    assert s.input_ids[0, : p + r].tolist() == prompt + episode.token_ids
    assert s.response_mask[0].tolist() == [0] * p + episode.action_mask
    assert s.attention_mask[0].tolist() == [1] * (p + r)  # the environment's tokens are context
    assert s.rollout_logp[0, p : p + r].tolist() == pytest.approx(episode.logprobs)
    assert s.response_mask[1].tolist() == [0] * p + [1] + [0] * (r - 1)
    assert s.response_ids[0] == episode.token_ids
    with pytest.raises(AgentError, match=r"test: action_ranges .* are not increasing spans"):
        episode_of({**result, "action_ranges": [(b, a)]}, tok, True, "test")
    with pytest.raises(AgentError, match="rollout_log_probs must give one number per observation token"):
        episode_of({**result, "rollout_log_probs": None}, tok, True, "test")


def test_an_agent_instance_step_answer_is_checked_and_its_numbers_taken_as_openrlhf_gives_them():
    where = "rollout.agent a.py: row 3: step 2"
    ok = check_step_result({"rewards": torch.tensor([1.5]), "scores": torch.tensor(1), "done": torch.tensor(True),
                            "environment_feedback": "x", "extra_logs": {"n": [2]}}, where)
    assert (ok["rewards"], ok["scores"], ok["done"], ok["extra_logs"]) == (1.5, 1.0, True, {"n": 2.0})
    assert "scores" not in check_step_result({"rewards": 0, "done": False, "scores": None}, where)  # default: the sum
    with pytest.raises(AgentError, match=r"row 3: step 2: rewards 'high'; expected a finite number"):
        check_step_result({"rewards": "high", "done": True}, where)
    with pytest.raises(AgentError, match=r"row 3: step 2: returned .*expected a dict with 'rewards', 'done'"):
        check_step_result((1.0, True), where)
    with pytest.raises(AgentError, match=r"done 'yes'; expected True or False"):
        check_step_result({"rewards": 1, "done": "yes"}, where)


def test_every_agent_shape_loads_and_an_unchanged_openrlhf_import_is_named(tmp_path):
    assert load_agent(str(AGENTS / "openrlhf_shape.py")).kind == "executor"
    assert load_agent("recipes/agents/arithmetic_retry.py").kind == "functions"
    only_instance = tmp_path / "instance.py"
    only_instance.write_text("from stages.common.agents import AgentInstanceBase\n"
                             "class AgentInstance(AgentInstanceBase):\n    async def step(self, states):\n        return {}\n")
    assert load_agent(str(only_instance)).kind == "instance"
    foreign = tmp_path / "foreign.py"
    foreign.write_text("class AgentExecutor:\n    pass\n")  # as an OpenRLHF file with a stand-in base class would be
    with pytest.raises(AgentError, match=r"foreign.py: AgentExecutor must inherit from AgentExecutorBase .*import line changed"):
        load_agent(str(foreign))


def test_the_built_in_agent_rewards_a_right_first_attempt_1_and_a_right_second_0_5():
    from stages.common.plugins import load_module

    agent = load_module("recipes/agents/arithmetic_retry.py", "test")
    state, obs = agent.reset("7+8", "15")
    assert obs is None
    assert agent.step(state, "15") == (None, 1.0, True, {"score": 1.0, "first_attempt_success": 1.0,
                                                          "second_attempt_success": pytest.approx(math.nan, nan_ok=True)})
    state, _ = agent.reset("7+8", "15")
    obs, reward, done, info = agent.step(state, "Work: 7+8=14, so 14")
    assert (obs, reward, done, info["score"]) == (RETRY, 0.0, False, 0.0)
    assert agent.step(state, "15")[1:3] == (0.5, True)
    state, _ = agent.reset("7+8", "15")
    agent.step(state, "1")
    assert agent.step(state, "2") == (RETRY, 0.0, True, {"score": 0.0, "first_attempt_success": 0.0, "second_attempt_success": 0.0})


def test_bad_agents_and_agent_configs_are_refused_by_name(tmp_path):
    bad = tmp_path / "agent.py"
    bad.write_text("def reset(prompt, label):\n    return None, None\n")
    with pytest.raises(AgentError, match=r"agent.py: defines no AgentExecutor or AgentInstance class .* no callable step\(state, action_text\)"):
        load_agent(str(bad))
    with pytest.raises(AgentError, match="not found"):
        load_agent(str(tmp_path / "missing.py"))
    data = {"paths": ["x.jsonl"]}
    with pytest.raises(ValueError, match="reward.func: rollout.agent's step gives the rewards"):
        RLConfig.model_validate({"data": data, "rollout": {"agent": "a.py"}, "reward": {"func": "r.py"}})
    with pytest.raises(ValueError, match="rollout.tools: without rollout.agent an episode is scored by the reward source"):
        RLConfig.model_validate({"data": data, "rollout": {"tools": "t.py"}})
    assert RLConfig.model_validate({"data": data, "rollout": {"agent": "a.py", "async": True}}).rollout.async_


def test_a_step_answer_of_the_wrong_shape_is_refused_naming_where():
    where = "rollout.agent agent.py: step 1"
    with pytest.raises(AgentError, match=r"agent.py: step 1: reward 'one'; expected a finite number"):
        check_step_answer(("ok", "one", False), where)
    with pytest.raises(AgentError, match=r"step 1: done 1; expected True or False"):
        check_step_answer(("ok", 1.0, 1), where)
    with pytest.raises(AgentError, match=r"expected \(observation, reward, done\)"):
        check_step_answer(("ok", 1.0), where)
    with pytest.raises(AgentError, match="info"):
        check_step_answer(("ok", 1.0, True, {"score": "yes"}), where)
    assert check_step_answer(("ok", 1, True, {"score": 1}), where) == ("ok", 1.0, True, {"score": 1.0})
