"""Held-out evaluation of causal-LM checkpoints with vLLM: task accuracy (greedy pass@1) and length.

Prompts are rendered exactly as in training (chat template or ``input_template``), handed to vLLM as
token ids, decoded greedily, and graded by the task's checker (the built-in addition task: the first
integer in the response must equal the label). Each checkpoint is evaluated in a subprocess of its
own, so vLLM's engine never lives in the caller's process.

Run: ``python -m stages.eval recipes/eval/tiny.yaml models=[runs/.../checkpoint]``
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from checkpoints import CheckpointRef, load_ref, require_kind, verify
from datasets_prep.loading import DataConfig, check_prompt_label_row, load_rows
from stages.common.launcher import launch


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: DataConfig
    max_new_tokens: int = 16
    seed: int = 0
    models: list[str] = []  # checkpoint folders, when run from the CLI
    output_root: str = "runs"


def run_eval(config: EvalConfig, *models: CheckpointRef) -> dict[str, dict[str, float]]:
    """Metrics per checkpoint, keyed by ``stage:digest[:8]``."""
    rows = load_rows(config.data, check_prompt_label_row(config.data))
    results = {}
    for ref in models:
        verify(ref)
        require_kind(ref, ("full",), "a model to evaluate (merge adapters first)")
        run_dir = Path(config.output_root) / f"eval-{ref.digest[:16]}"
        job = {"config": config.model_dump(mode="json"), "model": ref.path, "rows": rows}
        results[f"{ref.stage}:{ref.digest[:8]}"] = launch("stages.eval:eval_rank", job, 1, run_dir)
    return results


def eval_rank(job: dict, rank: int, world_size: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from datasets_prep.sft import render_prompt
    from datasets_prep.synthetic import is_correct
    from stages.common.generation import generate, make_llm

    config = EvalConfig.model_validate(job["config"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    prompts = [
        tokenizer(render_prompt(tokenizer, r[config.data.prompt_key], config.data), add_special_tokens=False)["input_ids"]
        for r in job["rows"]
    ]
    llm = make_llm(job["model"], seed=config.seed)
    outs = generate(llm, prompts, max_new_tokens=config.max_new_tokens, temperature=0.0)
    correct = [is_correct(o[0].text, str(r[config.data.label_key])) for o, r in zip(outs, job["rows"], strict=True)]
    return {
        "accuracy": sum(correct) / len(correct),
        "response_length": sum(len(o[0].token_ids) for o in outs) / len(outs),
        "n": len(outs),
    }


def main(argv: list[str] | None = None) -> None:
    from stages.common.recipe import load_config

    config = load_config(EvalConfig, argv)
    print(json.dumps(run_eval(config, *(load_ref(m) for m in config.models)), indent=2))


if __name__ == "__main__":
    main()
