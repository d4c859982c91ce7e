"""One RL step's throughput, side by side with TRL's GRPOTrainer on the same model and batch.

Same tiny model (the SFT output of the default recipe if given, else the tiny base), same prompts,
group size, generation length, learning rate and GRPO advantages. TRL runs on its transformers
generation backend (its vLLM colocate mode crashes on the CPU build at the first weight sync), with
and without gradient checkpointing (its default is on). The median of the second half of the steps
is reported for each system (the first steps are slower on both sides).

Two more tables explain the step: where our step's time goes (generation, reward, training, weight
sync), and generation alone, the same prompts x samples x tokens through vLLM (our engine wrapper,
fp32 and bf16) and through transformers' ``generate`` (TRL's backend). The step can only beat TRL by
what the rollout engine saves: both sides train on the same tokens with the same PyTorch kernels.

On CPU everything runs in fp32 (bf16 is slower there for these model sizes); on CUDA, in bf16.
Prints the tables and writes bench/results/rl_step.json.

``mode=sync``: the weight push alone, each ``sync.transport`` on the ``tiny`` and ``small`` presets in one run
(``python -m bench.rl_step mode=sync [presets=tiny,small] [steps=6] [learners=2] [engines=2]``; writes
bench/results/rl_sync.json).

``mode=vision``: the step on the tiny vision-language model (image prompts) beside the text model of its language
model's size (``python -m bench.rl_step mode=vision [steps=12] [prompts=32] [group=8]``; writes
bench/results/rl_step_vision.json).

Run: ``python -m bench.rl_step [model=PATH|preset=tiny] [steps=12] [prompts=32] [group=8] [tokens=16,128]
[max_tokens=2560] [generation=1] [systems=trl,trl16,ours,async,bf16]`` (``max_tokens``: our learner's
micro-batch budget in positions; another model than the default writes ``rl_step_<preset>.json``)
(needs ``pip install -e .[bench]`` for TRL)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "rl_step.json"
ROOT = Path(__file__).resolve().parents[1]


def settled(per_step: list) -> list:
    """The second half of the steps: both systems take several steps to reach their steady speed
    (allocator, thread pools, first-call compilation), ours about five on the 2-core CPU."""
    return per_step[len(per_step) // 2 :]


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def trl_step(model_path: str, prompts: list[str], labels: list[str], group: int, tokens: int, steps: int, checkpointing: bool,
             micro: int | None = None) -> dict:
    """TRL's step: the whole generation batch in one forward (``micro`` None) or ``micro`` samples per forward
    with gradient accumulation over the same 256-sample batch (one generation, one optimizer step)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from datasets_prep.synthetic import is_correct

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if cuda() else torch.float32)
    ds = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}], "answer": a} for p, a in zip(prompts, labels)] * (steps + 1)
    )

    def reward(completions, answer, **_):
        return [1.0 if is_correct(c[0]["content"], a) else 0.0 for c, a in zip(completions, answer)]

    times: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, per_device_train_batch_size=micro or len(prompts) * group, num_generations=group,
            gradient_accumulation_steps=(len(prompts) * group) // (micro or len(prompts) * group),
            max_completion_length=tokens, learning_rate=1e-5, max_steps=steps, logging_steps=1, report_to="none",
            use_cpu=not cuda(), bf16=cuda(), gradient_checkpointing=checkpointing, save_strategy="no", beta=0.0,
            loss_type="grpo", scale_rewards="group", temperature=1.0, seed=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, args=cfg, reward_funcs=reward, train_dataset=ds, processing_class=tok,
                              callbacks=[Clock()])
        trainer.train()
    step = statistics.median(settled(times))
    samples = len(prompts) * group
    mean_len = statistics.mean(settled(lengths))
    dtype = "bf16" if cuda() else "fp32"
    split = f", {micro} per forward" if micro else ""
    return {"system": f"TRL GRPOTrainer (transformers generate, {dtype}, grad ckpt {'on' if checkpointing else 'off'}{split})",
            "step_s": round(step, 3), "samples_per_s": round(samples / step, 1),
            "generated_tokens_per_s": round(samples * mean_len / step, 1), "mean_response_tokens": round(mean_len, 2)}


PHASES = ("generate_s", "reward_s", "reference_s", "train_s", "sync_s")


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """fp32 GFLOP/s of an n x n matmul on this process's threads (the learner's share of the cores), best of
    ``repeats``: the ceiling the training phase is measured against."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def training_flops(model_path: str, tokens_per_sample: float, samples: int) -> float:
    """Forward + backward FLOPs of one update over the step's samples (prompt + response positions, no
    padding): 6 x the non-embedding parameters per position, plus attention's 12 x layers x hidden x the mean
    context (half the sequence) per position (Kaplan et al. 2020)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    c = getattr(c, "text_config", None) or c  # a vision-language model: its language model (the tower is not counted)
    h, layers, inter, v = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    per_layer = 4 * h * h + 3 * h * inter  # q, k, v, o (no grouped heads in the presets) + the gated MLP
    params = layers * per_layer + h * v  # + the output head
    return samples * tokens_per_sample * (6 * params + 12 * layers * h * tokens_per_sample / 2)


def ours_step(model_path: str, group: int, prompts_n: int, tokens: int, steps: int, overrides: tuple[str, ...] = (),
              prompt_tokens: float = 0.0) -> dict:
    from checkpoints import import_pretrained, load_ref
    from stages.common.recipe import load_config
    from stages.rl.config import RLConfig
    from stages.rl.driver import run_rl

    with tempfile.TemporaryDirectory() as root:
        try:
            ref = load_ref(model_path)
        except Exception:
            ref = import_pretrained(model_path, root)
        cfg = load_config(RLConfig, [
            str(ROOT / "recipes/rl/tiny.yaml"), f"output_root={root}", f"max_steps={steps}", "eval_data=null",
            f"rollout.rollout_batch_size={prompts_n}", f"rollout.n_samples_per_prompt={group}",
            f"rollout.max_new_tokens={tokens}", f"train.train_batch_size={prompts_n * group}",
            f"train.micro_train_batch_size={prompts_n * group}", f"train.dtype={'bf16' if cuda() else 'fp32'}",
            f"rollout.dtype={'bfloat16' if cuda() else 'float32'}", "train.zero_stage=2",
            "train.lr=1e-5", "train.progress_bar=false", "algo.advantage_estimator=group_norm", *overrides,
        ])
        out = run_rl(cfg, ref)
        steps_m = [json.loads(ln) for ln in (Path(out.path).parent / "metrics.jsonl").read_text().splitlines()]
    timed = settled(steps_m)
    step = statistics.median(s["total_s"] for s in timed)
    mean_len = statistics.mean(s["response_length"] for s in timed)
    samples = prompts_n * group
    train_s = statistics.median(s["train_s"] for s in timed)
    flops = training_flops(model_path, prompt_tokens + mean_len, samples)
    budget = cfg.train.max_tokens_per_micro_batch
    split = f"{budget} positions per micro-batch" if budget else f"{cfg.train.micro_train_batch_size} per forward"
    mode = ", async (staleness 1, TIS)" if cfg.rollout.async_ else ""
    return {"system": f"rlhf-pipeline (vLLM {cfg.rollout.dtype} rollouts, DeepSpeed {cfg.train.dtype} learner, {split}{mode}, Ray)",
            "training_gflop_per_s": round(flops / train_s / 1e9, 1),
            "step_s": round(step, 3), "samples_per_s": round(samples / step, 1),
            "generated_tokens_per_s": round(samples * mean_len / step, 1), "mean_response_tokens": round(mean_len, 2),
            "generation_phase_tokens_per_s": round(statistics.median(s["generated_tokens_per_s"] for s in timed), 1),
            "phases": {k: round(statistics.median(s[k] for s in timed), 3) for k in PHASES},
            # the weight sync check passed at every step (else the run raised); its worst mean difference
            "worst_sync_logprob_diff": max(s["sync_logprob_diff"] for s in steps_m if "sync_logprob_diff" in s)}


def generation_only(model_path: str, prompt_ids: list[list[int]], group: int, tokens: int, repeats: int = 3) -> list[dict]:
    """The rollout engines alone: sampled tokens/s of vLLM (fp32, bf16) and of transformers' generate.

    The same rendered prompts, ``group`` samples each, temperature 1, up to ``tokens`` new tokens; the
    median of ``repeats`` calls after one warm-up call."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common.generation import generate, make_llm

    def timed(fn) -> tuple[float, int]:
        fn()
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            n = fn()
            runs.append((time.perf_counter() - t, n))
        return sorted(runs)[len(runs) // 2]

    def hf_tokens(model, batch) -> int:
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0,
                                 pad_token_id=tok.pad_token_id)
        return int((out[:, batch["input_ids"].shape[1]:] != tok.pad_token_id).sum())

    def vllm_tokens(llm) -> int:
        out = generate(llm, prompt_ids, n=group, max_new_tokens=tokens, temperature=1.0, seed=0)
        return sum(len(c.token_ids) for g in out for c in g)

    rows = []
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    dtypes = [("bfloat16", torch.bfloat16)] if cuda() else [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
    for name, dt in dtypes:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dt).to("cuda" if cuda() else "cpu")
        batch = tok.pad({"input_ids": [p for p in prompt_ids for _ in range(group)]}, return_tensors="pt").to(model.device)
        seconds, n = timed(lambda m=model, b=batch: hf_tokens(m, b))
        rows.append({"engine": f"transformers generate, {name}", "seconds": round(seconds, 3), "tokens": n,
                     "tokens_per_s": round(n / seconds, 1)})
        del model
        gc.collect()
    for name, _ in dtypes:
        llm = make_llm(model_path, dtype=name, seed=0)
        seconds, n = timed(lambda e=llm: vllm_tokens(e))
        rows.append({"engine": f"vLLM, {name}", "seconds": round(seconds, 3), "tokens": n, "tokens_per_s": round(n / seconds, 1)})
        del llm
        gc.collect()
    best_hf = max(r["tokens_per_s"] for r in rows if r["engine"].startswith("transformers"))
    for r in rows:
        r["vs_best_transformers"] = round(r["tokens_per_s"] / best_hf, 2)
    return rows


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])


SYSTEMS = ("trl", "trl16", "ours", "async", "bf16")


def setting(model: str, prompts: list[str], labels: list[str], prompt_ids: list[list[int]], group: int, tokens: int,
            steps: int, budget: int, with_generation: bool, systems: tuple[str, ...] = SYSTEMS) -> dict:
    """The ``systems`` at one response length, in the same process, one after the other: TRL whole-batch
    (``trl``) and 16 samples per forward (``trl16``), ours synchronous (``ours``), async (``async``) and with
    bf16 rollouts (``bf16``, CPU only)."""
    n = len(prompts)
    prompt_tokens = statistics.mean(len(p) for p in prompt_ids)
    budget_set = f"train.max_tokens_per_micro_batch={budget}"
    runs = {
        # gradient checkpointing on was slower than off at both lengths in earlier runs (bench/README.md)
        "trl": lambda: trl_step(model, prompts, labels, group, tokens, steps, checkpointing=False),
        "trl16": lambda: trl_step(model, prompts, labels, group, tokens, steps, checkpointing=False, micro=16),
        "ours": lambda: ours_step(model, group, n, tokens, steps, (budget_set,), prompt_tokens=prompt_tokens),
        # async: the engine samples step k+1 while the learners train step k; TIS corrects the one-update gap
        "async": lambda: ours_step(model, group, n, tokens, steps, (budget_set, "rollout.async=true", "algo.is_correction=tis"),
                                   prompt_tokens=prompt_tokens),
        # bf16 rollouts beside the fp32 learner, the sync check on tokens of p >= sync_min_prob
        "bf16": lambda: ours_step(model, group, n, tokens, steps, (budget_set, "rollout.dtype=bfloat16", "sync_tolerance=0.05"),
                                  prompt_tokens=prompt_tokens),
    }
    results = [runs[k]() for k in systems if not (k == "bf16" and cuda())]
    trl = [r["samples_per_s"] for r in results if r["system"].startswith("TRL")]
    for r in results:
        if trl:
            r["samples_per_s_vs_best_trl"] = round(r["samples_per_s"] / max(trl), 2)
    out = {"max_new_tokens": tokens, "results": results}
    if with_generation:
        out["generation_only"] = generation_only(model, prompt_ids, group, tokens)
    return out


TRANSPORTS = ("broadcast", "object_store")
SYNC_OUT = OUT.with_name("rl_sync.json")
VISION_OUT = OUT.with_name("rl_step_vision.json")


def vision_phase(steps: int, prompts_n: int, group: int) -> dict:
    """``mode=vision``: our RL step on the tiny vision-language model (image prompts from the visual task) beside the
    text model of its language model's size (``micro``, the addition task), same batch, same new tokens, in one run."""
    from stages.common.models import resolve_model

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for preset, what, extra in (
            ("micro", "text (micro Llama, addition prompts)", ()),
            ("tiny-vl", "vision-language (tiny-vl, visual-task image prompts)",
             (f"data.paths=[{ROOT / 'data/visual/rl_prompts.jsonl'}]", "data.image_key=images",
              f"reward={json.dumps({'func': str(ROOT / 'recipes/rewards/visual.py')})}")),
        ):
            model = resolve_model(f"tiny:{preset}", root).path
            r = ours_step(model, group, prompts_n, 4, steps, extra, prompt_tokens=12.0)
            rows.append({"model": what, "parameters_m": round(_parameters(model) / 1e6, 2), "step_s": r["step_s"],
                         **r["phases"], "worst_sync_logprob_diff": r["worst_sync_logprob_diff"]})
    return {"steps": steps, "prompts": prompts_n, "group": group, "max_new_tokens": 4, "rows": rows}


def sync_phase(presets: list[str], steps: int, learners: int, engines: int) -> dict:
    """``mode=sync``: the weight push's seconds per step with each ``sync.transport``, per model preset, in one run:
    the same short GRPO run (ZeRO-3 learners, the recipe's fp32 engines) once per transport; the median ``sync_s``
    (gather + transfer + load + the probe check) of the settled steps, and what one push moves."""
    from stages.common.models import resolve_model

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for preset in presets:
            model = resolve_model(f"tiny:{preset}", root).path
            params = _parameters(model)
            for transport in TRANSPORTS:
                r = ours_step(model, 4, 16, 16, steps, (f"sync.transport={transport}", "train.zero_stage=3",
                                                         f"train.world_size={learners}", f"rollout.num_engines={engines}",
                                                         f"train.micro_train_batch_size={64 // learners}"))
                rows.append({"preset": preset, "parameters_m": round(params / 1e6, 2), "push_mb": round(params * 4 / 2**20, 1),
                             "transport": transport, "sync_s": r["phases"]["sync_s"], "step_s": r["step_s"],
                             "worst_sync_logprob_diff": r["worst_sync_logprob_diff"]})
    for preset in presets:  # broadcast's sync time against the object store's, per preset
        by = {r["transport"]: r for r in rows if r["preset"] == preset}
        by["broadcast"]["sync_vs_object_store"] = round(by["broadcast"]["sync_s"] / by["object_store"]["sync_s"], 2)
    return {"steps": steps, "learners": learners, "engines": engines, "rows": rows}


def _parameters(model_path: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> None:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    if args.get("mode") == "sync":
        out = sync_phase(args.get("presets", "tiny,small").split(","), int(args.get("steps", 6)), int(args.get("learners", 2)),
                         int(args.get("engines", 2)))
        print(f"\nWeight push per RL step, each sync.transport ({out['learners']} ZeRO-3 learners, {out['engines']} engines, "
              f"fp32; median of the settled steps)\n")
        print(table([{**r, "sync_vs_object_store": r.get("sync_vs_object_store", "")} for r in out["rows"]],
                    ["preset", "parameters_m", "push_mb", "transport", "sync_s", "sync_vs_object_store", "step_s",
                     "worst_sync_logprob_diff"]))
        SYNC_OUT.parent.mkdir(parents=True, exist_ok=True)
        SYNC_OUT.write_text(json.dumps({"device": "cuda" if cuda() else "cpu", **out}, indent=2))
        print(f"wrote {SYNC_OUT}")
        return
    steps, n_prompts, group = int(args.get("steps", 12)), int(args.get("prompts", 32)), int(args.get("group", 8))
    if args.get("mode") == "vision":
        out = vision_phase(steps, n_prompts, group)
        print(f"\nRL step, text vs vision-language model of the same language-model size ({n_prompts} prompts x {group} "
              f"samples, 4 new tokens, fp32; median of the settled steps)\n")
        print(table(out["rows"], ["model", "parameters_m", "step_s", *PHASES, "worst_sync_logprob_diff"]))
        VISION_OUT.parent.mkdir(parents=True, exist_ok=True)
        VISION_OUT.write_text(json.dumps({"device": "cuda" if cuda() else "cpu", **out}, indent=2))
        print(f"wrote {VISION_OUT}")
        return
    lengths = [int(t) for t in args.get("tokens", "16,128").split(",")]
    budget = int(args.get("max_tokens", 2560))
    model = args.get("model")
    systems = tuple(args.get("systems", ",".join(SYSTEMS)).split(","))
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"systems: {unknown} unknown; valid: {', '.join(SYSTEMS)}")
    preset = args.get("preset", "tiny")
    # another model than the default one writes its own file (rl_step_<preset>.json), beside the default's
    out_path = OUT if model is None and preset == "tiny" else OUT.with_name(f"rl_step_{preset if model is None else 'model'}.json")
    with tempfile.TemporaryDirectory() as root:
        if model is None:
            from stages.common.models import resolve_model

            model = resolve_model(f"tiny:{preset}", root).path
        from transformers import AutoTokenizer

        from datasets_prep.sft import render_prompt
        from stages.common.recipe import load_config
        from stages.rl.config import RLConfig

        rows = [json.loads(ln) for ln in (ROOT / "data/arithmetic/rl_prompts.jsonl").read_text().splitlines()[:n_prompts]]
        prompts, labels = [r["prompt"] for r in rows], [r["answer"] for r in rows]
        data_cfg = load_config(RLConfig, [str(ROOT / "recipes/rl/tiny.yaml")]).data
        tok = AutoTokenizer.from_pretrained(model)
        prompt_ids = [tok(render_prompt(tok, p, data_cfg), add_special_tokens=False)["input_ids"] for p in prompts]
        peak = matmul_peak()
        settings = [setting(model, prompts, labels, prompt_ids, group, t, steps, budget, args.get("generation", "1") == "1",
                            systems) for t in lengths]
    for st in settings:
        for r in st["results"]:
            if "training_gflop_per_s" in r:
                r["training_share_of_peak"] = round(r["training_gflop_per_s"] / peak, 2)
        print(f"\nRL step, {n_prompts} prompts x {group} samples, up to {st['max_new_tokens']} new tokens, model {model}\n")
        print(table(st["results"], ["system", "step_s", "samples_per_s", "generated_tokens_per_s", "mean_response_tokens",
                                    *(["samples_per_s_vs_best_trl"] if "samples_per_s_vs_best_trl" in st["results"][0] else [])]))
        ours = [r for r in st["results"] if "phases" in r]
        print(f"\nWhere our step's time goes (median seconds); training FLOP/s against the measured fp32 matmul peak {peak:.1f} GFLOP/s\n")
        print(table([{"system": r["system"], **r["phases"], "training_gflop_per_s": r["training_gflop_per_s"],
                      "training_share_of_peak": r["training_share_of_peak"]} for r in ours],
                    ["system", *PHASES, "training_gflop_per_s", "training_share_of_peak"]))
        if "generation_only" in st:
            print("\nGeneration alone, same prompts x samples x tokens\n")
            print(table(st["generation_only"], ["engine", "seconds", "tokens", "tokens_per_s", "vs_best_transformers"]))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"prompts": n_prompts, "group": group, "steps": steps, "device": "cuda" if cuda() else "cpu",
                                    "model": model, "preset": None if args.get("model") else preset, "systems": list(systems),
                                    "matmul_peak_gflop_per_s": round(peak, 1), "settings": settings}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
