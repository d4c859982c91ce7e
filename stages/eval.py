"""Held-out evaluation of causal-LM checkpoints with vLLM, and its report (markdown table + PNG plot).

Per checkpoint, on held-out prompts rendered exactly as in training (chat template or
``input_template``) and handed to vLLM as token ids:

- ``accuracy``: pass@1 with greedy decoding, graded by the config's ``grader`` (stages.common.graders; the
  default ``arithmetic``: the last integer in the response must equal the label; ``math``: math-verify);
- ``pass@k``: from ``num_samples`` samples per prompt at ``temperature``, the unbiased estimator of
  Chen et al. 2021 (``1 - C(n-c, k) / C(n, k)``);
- ``response_length``: mean greedy response tokens;
- ``reward``: mean reward-model score of prompt + greedy response, when a reward model is given
  (normalised with the RM's stored mean/std when it has them);
- ``kl_to_reference``: when a reference is given, the mean over sampled responses of
  ``sum_t log p_model - log p_ref`` (the k1 estimate of the sequence KL; exact in expectation when
  ``temperature`` is 1). Both log-probs come from vLLM's scoring pass on the same token ids.

Each checkpoint is generated from in a subprocess of its own, and one more subprocess scores the
samples under the reference and the reward model, so vLLM's engine never lives in the caller's
process. The report (``report.md``, ``report.png``, ``metrics.json``) is written into
``<output_root>/eval-<key>/``, beside the checkpoints.

Run: ``python -m stages.eval recipes/eval/tiny.yaml 'models=[runs/sft-.../checkpoint]' [reward_model=...] [reference=...]``
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from checkpoints import CheckpointRef, require_kind, verify
from datasets_prep.loading import DataConfig, check_prompt_label_row, load_rows
from stages.common.config import PROMPT_DATA_UNUSED, ClusterConfig, StageConfig, section_unused
from stages.common.graders import grade, load_grader
from stages.common.launcher import launch
from stages.common.plots import y_scale
from stages.common.stage import POLICY, REPORT, REWARD, Input, StageRun, StageSpec, cli_run, logged

METRICS = ("accuracy", "pass@k", "response_length", "reward", "kl_to_reference")
# with an agent or tools (greedy episodes): the agent's summed step rewards, actions, tool calls and failures per episode
EPISODE_METRICS = ("episode_reward", "turns", "tool_calls", "tool_failures")
SHOWN_IMAGES = 4  # image prompts: the first rows' pictures in the report, with each model's greedy answer


class EvalConfig(StageConfig):
    model_config = ConfigDict(extra="forbid")
    UNUSED: ClassVar[dict[str, str]] = section_unused("data", PROMPT_DATA_UNUSED)

    data: DataConfig = Field(description="held-out prompts with their labels (label_key)")
    max_new_tokens: int = Field(16, ge=1, description="the longest response generated")
    num_samples: int = Field(8, ge=0, description="sampled responses per prompt, for pass@k and the KL estimate (0: greedy only)")
    pass_k: int = Field(8, ge=1, description="k of pass@k (at most num_samples)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the num_samples responses (greedy accuracy is always at 0)")
    grader: str = Field("arithmetic", description="what grades a response against the row's label (stages.common.graders): a built-in name (arithmetic: the embedded task; math: math-verify with #### / \\\\boxed{} extraction), module:function or file.py[:function]")
    timeout_s: float = Field(6 * 3600.0, gt=0, description="deadline of each generation / scoring subprocess")
    seed: int = Field(0, description="sampling")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="vLLM's dtype (float32: exact log-probs for the KL)")
    models: list[str] = Field([], description="checkpoint folders, when run from the CLI")
    reward_model: str | None = Field(None, description="from the CLI; flows pass references")
    reference: str | None = Field(None, description="a reference policy for kl_to_reference, from the CLI; flows pass references")
    output_root: str = Field("runs", description="where run folders go (<output_root>/<stage>-<run key>/)")
    cluster: ClusterConfig = Field(ClusterConfig(), description="cluster.address: each generation and the scoring run as a Ray actor on an existing cluster (a GPU each there)")
    agent: str | None = Field(None, description="run each held-out row as an agent episode (the RL stage's rollout.agent file: OpenRLHF's classes or reset/step); accuracy is then the episodes' mean score")
    tools: str | None = Field(None, description="tool calling in the held-out episodes (the RL stage's rollout.tools file); without an agent the grader grades each episode's last answer")
    tool_parser: str = Field("hermes", description="the tool-call format (as rollout.tool_parser)")
    max_tool_calls: int = Field(4, ge=0, description="tool calls an episode may make")
    max_turns: int = Field(2, ge=1, description="an episode's most actions (with an agent or tools)")
    env_timeout_s: float | None = Field(60.0, gt=0, description="the deadline of each environment call (reset, step, a tool)")
    max_model_len: int = Field(512, ge=1, description="prompt + response tokens the engine holds (an episode's whole context)")

    @model_validator(mode="after")
    def _pass_k_fits(self) -> EvalConfig:  # when the config is read (at planning), not when the eval stage starts
        if self.num_samples and self.pass_k > self.num_samples:
            raise ValueError(f"pass_k={self.pass_k} needs num_samples >= pass_k (got num_samples={self.num_samples})")
        return self


class EvalReport(BaseModel):
    """What the eval stage returns: metrics per model label and where the report files are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    folder: str
    markdown: str
    plot: str
    metrics: dict[str, dict[str, float | int | None]]

    def files_exist(self) -> bool:
        return all(Path(p).is_file() for p in (self.markdown, self.plot, Path(self.folder) / "metrics.json"))

    @classmethod
    def of_folder(cls, folder: Path) -> EvalReport:
        return cls(folder=str(folder), markdown=str(folder / "report.md"), plot=str(folder / "report.png"),
                   metrics=json.loads((folder / "metrics.json").read_text()))


def existing_report(run: StageRun) -> EvalReport | None:
    """The report a run of this identity finished (``metrics.json`` is written last)."""
    report = EvalReport.of_folder(run.run_dir) if (run.run_dir / "metrics.json").is_file() else None
    return report if report is not None and report.files_exist() else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def run_eval(
    config: EvalConfig,
    models: Mapping[str, CheckpointRef] | Sequence[CheckpointRef],
    reward_model: CheckpointRef | None = None,
    reference: CheckpointRef | None = None,
    *,
    run: StageRun | None = None,
) -> EvalReport:
    """Evaluate ``models`` ({label: checkpoint}; a plain list is labelled ``stage:digest[:8]``) and write the report."""
    models = _labelled(models)
    run = SPEC.identify(config, {"models": models, "reward_model": reward_model, "reference": reference}, run)
    rows = load_rows(config.data, check_prompt_label_row(config.data))
    check(config)  # a bad reference fails here, before any model loads
    check_images(config, rows, models.values())
    for ref, kinds, what in [*((ref, ("full",), "a model to evaluate (merge adapters first)") for ref in models.values()),
                             (reward_model, ("reward",), "the reward model of the eval stage"),
                             (reference, ("full",), "the KL reference of the eval stage")]:
        if ref is not None:
            verify(ref)
            require_kind(ref, kinds, what)
    with run.claimed() as folder:
        cfg = config.model_dump(mode="json")
        generated = {}
        for label, ref in models.items():
            job = {"config": cfg, "model": ref.path, "rows": rows}
            generated[label] = launch("stages.eval:generate_rank", job, 1, folder / f"generate-{ref.digest[:16]}", timeout_s=config.timeout_s,
                                      cluster=config.cluster, inputs=[ref.path])
        scores = {}
        if reward_model is not None or reference is not None:
            job = {"config": cfg, "generated": generated,
                   "reward_model": reward_model.path if reward_model else None, "reference": reference.path if reference else None}
            scores = launch("stages.eval:score_rank", job, 1, folder / "score", timeout_s=config.timeout_s, cluster=config.cluster,
                            inputs=[r.path for r in (reward_model, reference) if r is not None])
        metrics = {label: _row(generated[label], scores.get(label, {})) for label in models}
        shown = image_samples(folder, config, rows, {label: g.get("answers") or [] for label, g in generated.items()})
        return write_report(folder, config, metrics, shown)


def _labelled(models: Mapping[str, CheckpointRef] | Sequence[CheckpointRef]) -> Mapping[str, CheckpointRef]:
    """The models by label (a plain list: ``stage:digest[:8]`` each, every checkpoint once)."""
    if not models:
        raise ValueError("eval: no models to evaluate (give models=[...] or wire stages into the eval stage)")
    if isinstance(models, Mapping):
        return models
    labels = [f"{m.stage}:{m.digest[:8]}" for m in models]
    if len(set(labels)) != len(labels):
        raise ValueError(f"eval: the same checkpoint is given twice ({labels})")
    return dict(zip(labels, models, strict=True))


def _row(generated: dict, scored: dict) -> dict:
    """One model's row of the report, from its generation rank's answer and the scoring rank's."""
    return {"accuracy": generated["accuracy"], "pass@k": generated["pass_at_k"], "response_length": generated["response_length"],
            "reward": scored.get("reward"), "kl_to_reference": scored.get("kl_to_reference"), "n": generated["n"],
            **generated.get("episodes", {})}  # with an agent or tools: EPISODE_METRICS


def check_images(config: EvalConfig, rows: list[dict], models) -> None:
    """Image prompts (``data.image_key``): every row's images open, within ``max_images_per_prompt``, and every model
    is a vision-language model; before any model loads."""
    from datasets_prep.sft import prompt_images
    from stages.common.vision import is_vision

    if config.data.image_key is None:
        return
    for i, r in enumerate(rows):
        prompt_images(r, config.data, config.data.prompt_key, f"{config.data.paths[0]} row {i + 1}")
    if config.reference is not None or config.agent or config.tools:
        raise ValueError("eval: image prompts (data.image_key) are evaluated single-turn without a KL reference "
                         "(agents, tools and kl_to_reference on images: not yet)")
    for ref in models:
        if not is_vision(ref.path):
            raise ValueError(f"eval: data.image_key is set but {ref.path} is not a vision-language model (no vision_config)")


def image_samples(folder: Path, config: EvalConfig, rows: list[dict], answers: dict[str, list[str]]) -> str:
    """The first rows' pictures (PNG files in the report's folder) and each model's greedy answer, as markdown."""
    if config.data.image_key is None:
        return ""
    from datasets_prep.images import open_image
    from datasets_prep.sft import prompt_images

    lines = ["", "Sample image prompts (greedy answers):", "",
             "| image | prompt | label | " + " | ".join(answers) + " |", "|---|---|---|" + "---|" * len(answers)]
    for i, row in enumerate(rows[:SHOWN_IMAGES]):
        _, refs = prompt_images(row, config.data, config.data.prompt_key, f"row {i + 1}")
        cells = []
        for j, ref in enumerate(refs):
            name = f"sample-{i + 1}-{j + 1}.png"
            open_image(ref).resize((112, 112)).save(folder / name)
            cells.append(f"![row {i + 1}]({name})")
        prompt = row[config.data.prompt_key]
        said = [repr(a[i]) if i < len(a) else "-" for a in answers.values()]
        lines.append(f"| {' '.join(cells)} | {prompt if isinstance(prompt, str) else '(messages)'} | {row[config.data.label_key]} | "
                     + " | ".join(said) + " |")
    return "\n".join(lines) + "\n"


def write_report(folder: Path, config: EvalConfig, metrics: dict[str, dict], samples: str = "") -> EvalReport:
    """``metrics.json``, a markdown table and a PNG bar plot (one panel per metric, a bar per model, its value
    on it; a panel whose values span orders of magnitude on a log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    shown = [m for m in (*METRICS, *EPISODE_METRICS) if any(v.get(m) is not None for v in metrics.values())]
    names = {"pass@k": f"pass@{config.pass_k} (T={config.temperature:g})", "accuracy": "accuracy (greedy pass@1)"}
    lines = [
        f"Held-out eval on {', '.join(config.data.paths)} ({next(iter(metrics.values()))['n']} prompts)",
        "",
        "| model | " + " | ".join(names.get(m, m) for m in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for label, vals in metrics.items():
        cells = []
        for m in shown:
            v = vals.get(m)
            cells.append("-" if v is None else f"{v:.1%}" if m in ("accuracy", "pass@k") else f"{v:.2f}" if m in EPISODE_METRICS
                         else f"{v:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n" + samples
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.2), squeeze=False)
    for ax, m in zip(axes[0], shown, strict=True):
        labels = [label for label in metrics if metrics[label].get(m) is not None]
        values = [metrics[label][m] for label in labels]
        bars = ax.bar(labels, values, color="tab:blue")
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        scale = y_scale(values)  # e.g. KL: a random base's hundreds of nats beside trained models' few
        ax.set_yscale(**scale)
        ax.set_title(names.get(m, m) + ("" if scale["value"] == "linear" else " (log scale)"), fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    fig.tight_layout()
    plot = folder / "report.png"
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    (folder / "report.md").write_text(md)
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return EvalReport(folder=str(folder), markdown=str(folder / "report.md"), plot=str(plot), metrics=metrics)


def _prompts(config: EvalConfig, model: str, tokenizer, rows: list[dict]) -> tuple[list[list[int]], dict]:
    """The rows' prompt ids, and what generation needs besides for a vision-language model: each row's images (with
    ``data.image_key``) and the image tokens it must not sample."""
    from datasets_prep.sft import prompt_images, render_prompt
    from stages.common.vision import is_vision, vision_token_ids

    data = config.data
    shown = [prompt_images(r, data, data.prompt_key, f"row {i + 1}") for i, r in enumerate(rows)]
    prompts = [tokenizer(render_prompt(tokenizer, p, data), add_special_tokens=False)["input_ids"] for p, _ in shown]
    images = [refs for _, refs in shown] if data.image_key else None
    return prompts, dict(images=images, banned=vision_token_ids(tokenizer) if is_vision(model) else None)


def generate_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: greedy and sampled responses of one checkpoint, graded."""
    from transformers import AutoTokenizer

    from stages.common.generation import generate, make_llm

    config = EvalConfig.model_validate(job["config"])
    grader = load_grader(config.grader)
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    rows = job["rows"]
    labels = [r[config.data.label_key] for r in rows]
    prompts, see = _prompts(config, job["model"], tokenizer, rows)
    images = see["images"]
    llm = make_llm(job["model"], seed=config.seed, dtype=config.dtype, max_model_len=config.max_model_len,
                   max_images=config.data.max_images_per_prompt if see["banned"] is not None else None)
    if config.agent or config.tools:
        return _episodes_rank(config, llm, tokenizer, rows, grader)
    greedy = [g[0] for g in generate(llm, prompts, max_new_tokens=config.max_new_tokens, temperature=0.0, **see)]
    correct = [grade(grader, o.text, a, f"row {i + 1}") for i, (o, a) in enumerate(zip(greedy, labels, strict=True))]
    out = {
        "accuracy": sum(correct) / len(correct),
        "response_length": sum(len(o.token_ids) for o in greedy) / len(greedy),
        "n": len(greedy),
        "greedy": [o.prompt_ids + o.token_ids for o in greedy],
        "answers": [o.text for o in greedy[:SHOWN_IMAGES]] if images else [],
        "pass_at_k": None,
        "samples": [],
        "sample_logps": [],
    }
    if config.num_samples:
        out.update(_sampled(config, llm, prompts, labels, grader, see))
    return out


def _sampled(config: EvalConfig, llm, prompts: list[list[int]], labels: list, grader, see: dict) -> dict:
    """pass@k from ``num_samples`` samples per prompt, and the samples with their log-probs for the KL estimate
    (text prompts only: the KL on image prompts is not estimated yet)."""
    from stages.common.generation import generate

    sampled = generate(llm, prompts, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                       n=config.num_samples, seed=config.seed, **see)
    hits = [sum(grade(grader, c.text, a, f"row {i + 1}") >= 1.0 for c in group)
            for i, (group, a) in enumerate(zip(sampled, labels, strict=True))]
    if see["images"] is not None:
        return {"pass_at_k": _mean_pass_at_k(config, hits)}
    samples = [[c.prompt_ids, c.token_ids] for group in sampled for c in group]
    return {"pass_at_k": _mean_pass_at_k(config, hits), "samples": samples, "sample_logps": _response_logps(llm, samples)}


def _mean_pass_at_k(config: EvalConfig, hits: list[int]) -> float:
    """The mean pass@k over the prompts, from each prompt's count of right samples among ``num_samples``."""
    return sum(pass_at_k(config.num_samples, c, config.pass_k) for c in hits) / len(hits)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _episode_means(episodes: list, tools: bool) -> dict[str, float | None]:
    """EPISODE_METRICS over the greedy episodes (the tool counts None without tools)."""
    return {"episode_reward": _mean([e.reward for e in episodes if e.reward is not None]),
            "turns": _mean([float(e.turns) for e in episodes]),
            "tool_calls": _mean([e.info["tool_calls"] for e in episodes]) if tools else None,
            "tool_failures": _mean([e.info["tool_failures"] for e in episodes]) if tools else None}


def _episodes_rank(config: EvalConfig, llm, tokenizer, rows: list[dict], grader) -> dict:
    """``generate_rank`` with an agent or tools: each row a greedy episode (and ``num_samples`` sampled ones for
    pass@k), every episode in flight at once (``stages.common.episodes``). Success: the agent's score, or (tools only)
    the grader on the episode's last answer; the response: the whole trajectory after the prompt, whose
    environment tokens the KL estimate leaves out."""
    from datasets_prep.sft import render_prompt
    from stages.common.agents import last_answer
    from stages.common.episodes import EpisodeRunner, Spec, episode_jobs
    from stages.common.tools import load_tools

    data = config.data
    schemas = load_tools(config.tools).schemas if config.tools else None
    runner = EpisodeRunner(llm, tokenizer)

    def run(n: int, temperature: float, logprobs: bool) -> list[list]:
        groups = episode_jobs(rows, list(range(len(rows))), data, n, config.seed,
                              lambda p, _: render_prompt(tokenizer, p, data, tools=schemas))
        jobs = [j for g in groups for j in g]
        spec = Spec(config.agent, config.tools, config.tool_parser, config.max_tool_calls, config.max_turns,
                    config.max_new_tokens, config.max_model_len, temperature, logprobs, config.env_timeout_s, 256, data)
        flat = runner.run(jobs, spec)
        return [flat[i * n : (i + 1) * n] for i in range(len(rows))]

    def success(ep, row: dict, i: int) -> float:
        if config.agent:
            return ep.score
        return grade(grader, last_answer(tokenizer, ep), row[data.label_key], f"row {i + 1}")

    greedy = [g[0] for g in run(1, 0.0, False)]
    correct = [success(ep, r, i) for i, (ep, r) in enumerate(zip(greedy, rows, strict=True))]

    out = {
        "accuracy": sum(correct) / len(correct),
        "response_length": _mean([float(len(e.token_ids)) for e in greedy]),
        "n": len(greedy),
        "greedy": [e.prompt_ids + e.token_ids for e in greedy],
        "pass_at_k": None, "samples": [], "sample_logps": [],
        "episodes": _episode_means(greedy, bool(config.tools)),
    }
    if config.num_samples:
        sampled = run(config.num_samples, config.temperature, False)
        hits = [sum(success(ep, r, i) >= 1.0 for ep in group) for i, (group, r) in enumerate(zip(sampled, rows, strict=True))]
        out["pass_at_k"] = _mean_pass_at_k(config, hits)
        out["samples"] = [[e.prompt_ids, e.token_ids, e.action_mask] for group in sampled for e in group]
        out["sample_logps"] = _response_logps(llm, out["samples"])
    return out


def _response_logps(llm, samples: list[list[list[int]]]) -> list[float]:
    """Sum of log-probs of each response's tokens given its prompt, from vLLM's scoring pass (a sample with an
    action mask, an episode: of the model's tokens only)."""
    from stages.common.generation import sequence_logprobs

    seqs = [s[0] + s[1] for s in samples]
    out = []
    for lps, s in zip(sequence_logprobs(llm, seqs), samples, strict=True):
        resp = lps[len(s[0]) - 1 :]
        out.append(sum(v for v, m in zip(resp, s[2], strict=True) if m) if len(s) > 2 else sum(resp))
    return out


def score_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: reference log-probs of every model's samples, reward-model scores of greedy responses."""
    out: dict[str, dict] = {label: {} for label in job["generated"]}
    if job["reference"]:
        from stages.common.generation import make_llm

        llm = make_llm(job["reference"], seed=0, dtype=job["config"]["dtype"])
        for label, g in job["generated"].items():
            if g["samples"]:
                ref = _response_logps(llm, g["samples"])
                out[label]["kl_to_reference"] = sum(a - b for a, b in zip(g["sample_logps"], ref, strict=True)) / len(ref)
    if job["reward_model"]:
        from stages.common.scoring import RewardModelScorer

        scorer = RewardModelScorer(job["reward_model"], normalize=None)  # normalised when the RM has its stats
        for label, g in job["generated"].items():
            scores = scorer.score(g["greedy"])
            out[label]["reward"] = sum(scores) / len(scores)
    return out


def main(argv: list[str] | None = None) -> None:
    report = cli_run(SPEC, argv)
    print(Path(report.markdown).read_text())
    print(f"[eval] report: {report.markdown}, plot: {report.plot}")


def check(config: EvalConfig) -> None:
    """Before anything starts: the grader, the agent and the tools load."""
    load_grader(config.grader)
    if config.agent:
        from stages.common.agents import load_agent

        load_agent(config.agent)
    if config.tools:
        from stages.common.tools import load_tools

        load_tools(config.tools)


SPEC = StageSpec(
    "eval", EvalConfig, run_eval,
    (Input("models", (POLICY,), field="models", required=True, many=True), Input("reward_model", (REWARD,), field="reward_model"),
     Input("reference", (POLICY,), field="reference")),
    output=REPORT, files=("data.paths", "grader", "agent", "tools"), plugins=("grader", "agent", "tools"), result=EvalReport,
    existing=existing_report,
    check=lambda config: check(config),  # a bad grader, agent or tools reference fails before anything starts
    metrics=lambda config: logged(METRICS, EPISODE_METRICS if config.agent or config.tools else (), "n"),  # each model's
)

if __name__ == "__main__":
    main()
