"""Reward for the built-in tool task: 1 when the last answer of the episode (after its tool calls) is the
product, else 0. Queries are decoded with their special tokens (episodes: OpenRLHF's way), so the model's last
turn is the text after the last ``<|assistant|>``; the tool's own answer earns nothing. Used by
recipes/rl/tools.yaml."""

from datasets_prep.synthetic import extract_answer
from datasets_prep.tool_task import final_answer


def reward_func(queries, prompts, labels):
    rewards = [1.0 if extract_answer(final_answer(q[len(p):])) == str(label).strip() else 0.0
               for q, p, label in zip(queries, prompts, labels)]
    calls = [float("<tool_call>" in q[len(p):]) for q, p in zip(queries, prompts)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"called_tool": calls}}
