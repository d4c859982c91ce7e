"""A test agent written against OpenRLHF's documented interface (``openrlhf.utils.agent``), with only its import
line changed. Each step rewards ``turn * hit`` (hit: the action starts with the digit 1), so an episode's reward
is the sum over its turns and its score the last step's ``scores`` (the last hit); ``extra_logs`` the hits so
far. Three turns; each step awaits a short random sleep, so episodes finish in a different order every run."""

import asyncio
import random

import torch

from stages.common.agents import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 3
FEEDBACK = {"role": "user", "content": "again"}


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.hits = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        await asyncio.sleep(random.random() * 0.05)
        self.turn += 1
        hit = states["action_text"].startswith("1")
        self.hits += hit
        return {
            "rewards": torch.tensor(float(self.turn * hit)),
            "scores": torch.tensor(float(hit)),
            "environment_feedback": "<|user|>again<|end|><|assistant|>",
            "done": self.turn >= TURNS,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"hits": torch.tensor(self.hits)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
