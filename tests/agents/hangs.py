"""A test agent whose environment never answers on the row labelled "9" (a hung sandbox), in the functional form
with async functions."""

import asyncio


async def reset(prompt, label):
    return {"label": label}, None


async def step(state, action_text):
    if state["label"] == "9":
        await asyncio.sleep(3600)
    return None, 1.0, True
