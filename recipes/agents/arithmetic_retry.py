"""A two-attempt agent on the built-in addition task (``rollout.agent: recipes/agents/arithmetic_retry.py``).

The environment checks each answer (its last integer against the sum). A right first attempt earns 1; a wrong
one gets "wrong, try again" as the next user turn, and a right second attempt earns ``DISCOUNT``. Metrics:
``first_attempt_success`` (every episode) and ``second_attempt_success`` (episodes that needed a second attempt);
the score is whether the episode ended solved.
"""

from datasets_prep.synthetic import is_correct

DISCOUNT = 0.5
ATTEMPTS = 2
RETRY = {"role": "user", "content": "wrong, try again"}


def reset(prompt, label):
    return {"label": label, "attempt": 0}, None


def step(state, action_text):
    state["attempt"] += 1
    attempt, right = state["attempt"], is_correct(action_text, state["label"])
    info = {"score": float(right), "first_attempt_success": float(right and attempt == 1),
            "second_attempt_success": float(right) if attempt == 2 else float("nan")}
    if right:
        return None, 1.0 if attempt == 1 else DISCOUNT, True, info
    return RETRY, 0.0, attempt >= ATTEMPTS, info
