"""One RL step's throughput, side by side with TRL's GRPOTrainer on the same model and batch.

Same tiny model (the SFT output of the default recipe if given, else the tiny base), same prompts,
group size, generation length, learning rate and GRPO advantages. TRL runs on its transformers
generation backend in fp32 (its vLLM colocate mode crashes on the CPU build at the first weight
sync), with and without gradient checkpointing (its default is on). Steps after the first are
timed; prints a table and writes bench/results/rl_step.json.

Run: ``python -m bench.rl_step [model=PATH] [steps=4] [prompts=32] [group=8] [tokens=16]``
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


def trl_step(model_path: str, prompts: list[str], labels: list[str], group: int, tokens: int, steps: int, checkpointing: bool) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from datasets_prep.synthetic import is_correct

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
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
            output_dir=out, per_device_train_batch_size=len(prompts) * group, num_generations=group,
            max_completion_length=tokens, learning_rate=1e-5, max_steps=steps, logging_steps=1, report_to="none",
            use_cpu=True, bf16=False, gradient_checkpointing=checkpointing, save_strategy="no", beta=0.0,
            loss_type="grpo", scale_rewards="group", temperature=1.0, seed=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, args=cfg, reward_funcs=reward, train_dataset=ds, processing_class=tok,
                              callbacks=[Clock()])
        trainer.train()
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    samples = len(prompts) * group
    mean_len = statistics.mean(lengths[1:] or lengths)
    return {"system": f"TRL GRPOTrainer (transformers generate, fp32, grad ckpt {'on' if checkpointing else 'off'})",
            "step_s": round(step, 3), "samples_per_s": round(samples / step, 1),
            "generated_tokens_per_s": round(samples * mean_len / step, 1), "mean_response_tokens": round(mean_len, 2)}


def ours_step(model_path: str, group: int, prompts_n: int, tokens: int, steps: int, dtype: str) -> dict:
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
            f"train.micro_train_batch_size={prompts_n * group}", f"train.dtype={dtype}", "train.zero_stage=2",
            "train.lr=1e-5", "train.progress_bar=false", "algo.advantage_estimator=group_norm",
        ])
        out = run_rl(cfg, ref)
        steps_m = [json.loads(ln) for ln in (Path(out.path).parent / "metrics.jsonl").read_text().splitlines()]
    timed = steps_m[1:] or steps_m
    step = statistics.median(s["total_s"] for s in timed)
    mean_len = statistics.mean(s["response_length"] for s in timed)
    samples = prompts_n * group
    return {"system": f"rlhf-pipeline (vLLM {cfg.rollout.dtype} rollouts, DeepSpeed {dtype} learner, Ray)",
            "step_s": round(step, 3), "samples_per_s": round(samples / step, 1),
            "generated_tokens_per_s": round(samples * mean_len / step, 1), "mean_response_tokens": round(mean_len, 2),
            "generation_phase_tokens_per_s": round(statistics.median(s["generated_tokens_per_s"] for s in timed), 1)}


def main(argv: list[str] | None = None) -> None:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    steps, n_prompts, group, tokens = int(args.get("steps", 4)), int(args.get("prompts", 32)), int(args.get("group", 8)), int(args.get("tokens", 16))
    model = args.get("model")
    with tempfile.TemporaryDirectory() as root:
        if model is None:
            from stages.common.models import resolve_model

            model = resolve_model("tiny:tiny", root).path
        rows = [json.loads(ln) for ln in (ROOT / "data/arithmetic/rl_prompts.jsonl").read_text().splitlines()[:n_prompts]]
        prompts, labels = [r["prompt"] for r in rows], [r["answer"] for r in rows]
        results = [
            trl_step(model, prompts, labels, group, tokens, steps, checkpointing=True),
            trl_step(model, prompts, labels, group, tokens, steps, checkpointing=False),
            ours_step(model, group, n_prompts, tokens, steps, "fp32"),
        ]
    best_trl = max(r["samples_per_s"] for r in results[:2])
    for r in results:
        r["samples_per_s_vs_best_trl"] = round(r["samples_per_s"] / best_trl, 2)
    cols = ["system", "step_s", "samples_per_s", "generated_tokens_per_s", "mean_response_tokens", "samples_per_s_vs_best_trl"]
    print(f"\nRL step, {n_prompts} prompts x {group} samples, up to {tokens} new tokens, model {model}\n")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"prompts": n_prompts, "group": group, "max_new_tokens": tokens, "steps": steps,
                               "model": model, "results": results}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
