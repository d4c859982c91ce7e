"""Reward for the built-in addition task: 1 when the response's last integer is the sum, else 0.

OpenRLHF's reward_func contract: queries are prompt + response texts, labels the dataset's label
column (here the answer). Used by recipes/rl/tiny.yaml.
"""

from datasets_prep.synthetic import extract_answer


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        rewards.append(1.0 if extract_answer(response) == str(label).strip() else 0.0)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
