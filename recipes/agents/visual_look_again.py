"""A two-look agent on the built-in visual task, in OpenRLHF's shape (``rollout.agent: recipes/agents/visual_look_again.py``).

The model answers the row's picture question. A right first answer earns 1. A wrong one is shown a second picture
with the same answer (another scene with as many shapes, or a circle of the same colour) as the next user turn:
the picture travels as OpenRLHF's ``environment_images``, the turn as a chat message whose ``{"type": "image"}``
part the chat template renders as the image token. A right second answer earns ``DISCOUNT``. Metrics:
``first_look_success`` (every episode), ``second_look_success`` (episodes shown a second picture). An OpenRLHF VLM
agent file runs after changing its import line to ``stages.common.agents``.
"""

import random
import zlib

from datasets_prep.visual_task import QUESTION, draw, scene_for
from stages.common.agents import AgentInstanceBase, MultiTurnAgentExecutor
from stages.common.graders import first_word_correct

DISCOUNT = 0.5


class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        self.looks = 0
        self.question = QUESTION.search(states["observation"]).group(0)
        # the second picture depends on the episode's prompt only: a rerun (or a resumed run) shows the same one
        self.rng = random.Random(zlib.crc32(states["observation"].encode()))
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.looks += 1
        right = first_word_correct(states["action_text"], states["label"])
        if self.looks == 1:
            self.first = float(right)
        # the last step's extra_logs are logged: each carries the first look's result
        logs = {"first_look_success": self.first, "second_look_success": float(right) if self.looks == 2 else float("nan")}
        if right or self.looks == 2:
            reward = (1.0 if self.looks == 1 else DISCOUNT) if right else 0.0
            return {"rewards": reward, "scores": float(right), "environment_feedback": "", "done": True, "extra_logs": logs}
        picture = draw(scene_for(self.question, str(states["label"]), self.rng), self.rng)
        turn = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Look again. {self.question}"}]}
        return {"rewards": 0.0, "environment_feedback": turn, "environment_images": [picture], "done": False,
                "extra_logs": logs}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
