"""Multi-turn agent trajectories: the model's tokens kept exactly as sampled, the environment's appended as
tokens and masked out of the loss; the built-in two-attempt agent's rewards; bad agents named before any work."""

from __future__ import annotations

import math

import pytest

from stages.common.generation import Completion
from stages.rl.agents import AgentError, ObservationTokens, Trajectory, check_step_answer, load_agent
from stages.rl.config import RLConfig
from stages.rl.experience import Samples

RETRY = {"role": "user", "content": "wrong, try again"}


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _action(tok, prompt: list[int], text: str, logprobs: list[float] | None = None) -> Completion:
    ids = _ids(tok, text) + [tok.eos_token_id]  # as vLLM returns a stopped completion: the stop token included
    return Completion(prompt, ids, text, logprobs or [-0.5] * len(ids), "stop")


def test_a_trajectory_is_the_sampled_tokens_and_the_chat_rendered_observation_with_the_loss_on_actions_only(tokenizer):
    tok = tokenizer
    prompt = _ids(tok, tok.apply_chat_template([{"role": "user", "content": "7+8"}], add_generation_prompt=True, tokenize=False))
    first = _action(tok, prompt, "14", [-0.1, -0.2, -0.3])
    t = Trajectory(list(prompt), state=None)
    t.act(first)
    obs = ObservationTokens(tok)(RETRY, "test")
    t.observe(obs)
    second = _action(tok, t.context, "15", [-0.4, -0.5, -0.6])
    t.act(second)
    # bit for bit: the sampled ids, then the observation's, then the sampled ids again
    assert t.token_ids == first.token_ids + obs + second.token_ids
    assert t.action_mask == [1] * 3 + [0] * len(obs) + [1] * 3
    assert t.logprobs == [-0.1, -0.2, -0.3] + [0.0] * len(obs) + [-0.4, -0.5, -0.6]
    # the same text the chat template renders for the whole conversation
    conversation = [{"role": "user", "content": "7+8"}, {"role": "assistant", "content": "14"}, RETRY,
                    {"role": "assistant", "content": "15"}]
    assert tok.decode(t.context) == tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(obs) == "<|user|>wrong, try again<|end|><|assistant|>"
    # a string observation is appended as it is
    assert ObservationTokens(tok)("Try: 12", "test") == _ids(tok, "Try: 12")

    t.reward, t.info = 0.5, {"score": 1.0, "second_attempt_success": 1.0}
    episode = t.episode(tok, with_logprobs=True)
    assert (episode.score, episode.turns, episode.info) == (1.0, 2, {"second_attempt_success": 1.0})
    other = Completion(list(prompt), [tok.eos_token_id], "", [-2.0], "stop")  # a one-token single-turn sample
    s = Samples.of([0], [[episode, other]], tok.pad_token_id, with_logp=True)
    p, r = len(prompt), len(episode.token_ids)
    assert s.input_ids[0, : p + r].tolist() == prompt + episode.token_ids
    assert s.response_mask[0].tolist() == [0] * p + episode.action_mask
    assert s.attention_mask[0].tolist() == [1] * (p + r)  # the environment's tokens are context
    assert s.rollout_logp[0, p : p + r].tolist() == pytest.approx(episode.logprobs)
    assert s.response_mask[1].tolist() == [0] * p + [1] + [0] * (r - 1)
    assert s.response_ids[0] == episode.token_ids


def test_the_built_in_agent_rewards_a_right_first_attempt_1_and_a_right_second_0_5():
    agent = load_agent("recipes/agents/arithmetic_retry.py")
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
    with pytest.raises(AgentError, match=r"agent.py: defines no callable step\(state, action_text\)"):
        load_agent(str(bad))
    with pytest.raises(AgentError, match="not found"):
        load_agent(str(tmp_path / "missing.py"))
    data = {"paths": ["x.jsonl"]}
    with pytest.raises(ValueError, match="reward.func: rollout.agent's step gives the rewards"):
        RLConfig.model_validate({"data": data, "rollout": {"agent": "a.py"}, "reward": {"func": "r.py"}})
    with pytest.raises(ValueError, match="rollout.async: not supported with rollout.agent"):
        RLConfig.model_validate({"data": data, "rollout": {"agent": "a.py", "async": True}})


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
