"""Reward for the built-in visual task (datasets_prep.visual_task): 1 when the response's first word is the answer.

OpenRLHF's reward_func contract: queries are prompt + response texts (the image tokens left out), labels the
dataset's label column. Used by recipes/rl/visual.yaml.
"""

from stages.common.graders import first_word_correct


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        rewards.append(1.0 if first_word_correct(response, label) else 0.0)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
