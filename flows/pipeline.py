"""Pipeline recipes: which stages run, in which order, each with its stage recipe, overrides and inputs.

A pipeline recipe (``recipes/pipelines/*.yaml``)::

    name: tiny
    output_root: runs
    stages:
      - {name: base, stage: tiny_model, overrides: {preset: tiny}}
      - {name: sft, stage: sft, recipe: recipes/sft/tiny.yaml, inputs: {base: base}, retries: 1}
      - {name: rm, stage: reward_model, recipe: recipes/reward_model/tiny.yaml, inputs: {base: sft}}
      - {name: eval, stage: eval, recipe: recipes/eval/tiny.yaml, inputs: {models: [base, sft], reward_model: rm}}

Everything is checked by :func:`plan` before any stage runs: the stage types, that every input names
an earlier stage whose output fits (a reward model is not a policy; only an adapter can be merged),
and every stage recipe with its overrides against the stage's config. Errors name the pipeline file
and the path of the bad field (``stages[2].inputs.policy``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stages.common.recipe import (
    RecipeError,
    format_validation_error,
    read_recipe,
    read_yaml,
    set_dotted,
    validate,
)
from stages.common.worker import load_target

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# what a stage's output is, for checking the wiring: policy (a full causal LM), reward (a full reward
# model), adapter (LoRA weights on a base), report (eval's report; never an input)
POLICY, REWARD, ADAPTER, REPORT = "policy", "reward", "adapter", "report"


@dataclass(frozen=True)
class Input:
    name: str
    accepts: tuple[str, ...]
    required: bool = False  # else the config's ``fallback`` field (a model spec) is used, or nothing
    many: bool = False
    fallback: str | None = None


@dataclass(frozen=True)
class StageType:
    config: str  # "module:Class"
    run: str  # "module:function"
    inputs: tuple[Input, ...] = ()
    # source files (globs relative to the project root) whose contents are the stage's code version
    sources: tuple[str, ...] = ()
    output: str = POLICY


COMMON_SOURCES = ("checkpoints/*.py", "datasets_prep/*.py", "stages/common/*.py")

STAGES: dict[str, StageType] = {
    "tiny_model": StageType("stages.tiny_model:TinyModelConfig", "stages.tiny_model:run_tiny_model",
                            sources=("stages/tiny_model.py",)),
    "sft": StageType("stages.sft:SFTConfig", "stages.sft:run_sft",
                     (Input("base", (POLICY,), fallback="base"),), ("stages/sft.py",)),
    "reward_model": StageType("stages.reward_model:RewardModelConfig", "stages.reward_model:run_reward_model",
                              (Input("base", (POLICY,), fallback="base"),), ("stages/reward_model.py",), REWARD),
    "dpo": StageType("stages.dpo:DPOConfig", "stages.dpo:run_dpo",
                     (Input("policy", (POLICY,), fallback="base"), Input("reference", (POLICY,), fallback="reference")),
                     ("stages/dpo.py",)),
    "rl": StageType("stages.rl.config:RLConfig", "stages.rl.driver:run_rl",
                    (Input("policy", (POLICY,), fallback="base"), Input("reward_model", (REWARD,))),
                    ("stages/rl/*.py", "stages/reward_model.py")),
    "lora_merge": StageType("stages.lora_merge:LoraMergeConfig", "stages.lora_merge:run_lora_merge",
                            (Input("adapter", (ADAPTER,), required=True), Input("base", (POLICY,), fallback="base")),
                            ("stages/lora_merge.py",)),
    "eval": StageType("stages.eval:EvalConfig", "stages.eval:run_eval",
                      (Input("models", (POLICY,), required=True, many=True), Input("reward_model", (REWARD,), fallback="reward_model"),
                       Input("reference", (POLICY,), fallback="reference")),
                      ("stages/eval.py", "stages/rl/rewards.py", "stages/reward_model.py"), REPORT),
}


_FILE_HASHES: dict[tuple[str, int, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file's contents, remembered while its inode, size and times stay the same (a flow computes
    each stage's cache key several times: large data files are read once). A file modified in the last two
    seconds is never remembered: file times are coarse, and a second edit within the same tick could look
    unchanged. (A copy that keeps an old modification time still gets a new change time, and so a new key.)"""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _FILE_HASHES:
        return _FILE_HASHES[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if time.time_ns() - st.st_mtime_ns > 2_000_000_000:
        _FILE_HASHES[key] = h.hexdigest()
    return h.hexdigest()


def digest_files(named: list[tuple[str, Path]]) -> str:
    """One sha256 over (name, contents) pairs: a file renamed or edited changes it."""
    h = hashlib.sha256()
    for name, path in named:
        h.update(name.encode() + b"\0" + file_sha256(path).encode() + b"\0")
    return h.hexdigest()


def code_version(stage: str) -> str:
    """sha256 over the stage's source files and the shared code it runs on (paths and contents)."""
    named = []
    for pattern in (*STAGES[stage].sources, *COMMON_SOURCES):
        paths = [Path(pattern)] if Path(pattern).is_absolute() else sorted(PROJECT_ROOT.glob(pattern))
        for path in paths:
            named.append((path.relative_to(PROJECT_ROOT).as_posix() if path.is_relative_to(PROJECT_ROOT) else str(path), path))
    return digest_files(named)


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    stage: str
    recipe: str | None = None  # the stage recipe (YAML); None: the config's defaults
    overrides: dict[str, Any] = {}  # dotted keys -> values, applied over the recipe
    inputs: dict[str, str | list[str]] = {}  # input name -> earlier stage name(s)
    retries: int = Field(0, ge=0)
    retry_delay_seconds: float = Field(10.0, ge=0)


class PipelineRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    output_root: str = "runs"
    stages: list[StageSpec] = Field(min_length=1)


@dataclass
class PlannedStage:
    spec: StageSpec
    config: BaseModel
    output: str  # the kind of its output: POLICY, REWARD, ADAPTER or REPORT


@dataclass
class Plan:
    recipe: PipelineRecipe
    stages: list[PlannedStage] = field(default_factory=list)


def plan(source: str | Path, output_root: str | None = None, stage_overrides: dict[str, dict[str, Any]] | None = None) -> Plan:
    """Read and check a pipeline recipe and every stage recipe in it; nothing runs."""
    source = str(source)
    return plan_data(read_yaml(_resolve(source)), source, output_root, stage_overrides)


def plan_data(data: dict[str, Any], source: str, output_root: str | None = None,
              stage_overrides: dict[str, dict[str, Any]] | None = None) -> Plan:
    """:func:`plan` of a pipeline recipe already read (``source`` names it in errors)."""
    if output_root is not None:
        data["output_root"] = output_root
    try:
        recipe = PipelineRecipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, source)) from None
    unknown = set(stage_overrides or {}) - {s.name for s in recipe.stages}
    if unknown:
        raise RecipeError(f"{source}: overrides for stages {sorted(unknown)} that the pipeline does not have "
                          f"(its stages: {[s.name for s in recipe.stages]})")
    out = Plan(recipe)
    produced: dict[str, str] = {}  # stage name -> output kind
    types: dict[str, str] = {}  # stage name -> stage type
    for i, spec in enumerate(recipe.stages):
        where = f"{source}: stages[{i}] ({spec.name})"
        if spec.stage not in STAGES:
            raise RecipeError(f"{where}.stage: unknown stage {spec.stage!r}; expected one of {sorted(STAGES)}")
        if spec.name in produced:
            raise RecipeError(f"{where}.name: {spec.name!r} is used by an earlier stage; stage names must be unique")
        stype = STAGES[spec.stage]
        overrides = {**spec.overrides, **((stage_overrides or {}).get(spec.name) or {})}
        config = _load_stage_config(stype, spec, overrides, recipe.output_root, where)
        known = {inp.name: inp for inp in stype.inputs}
        for name in spec.inputs:
            if name not in known:
                raise RecipeError(f"{where}.inputs.{name}: the {spec.stage} stage takes no input {name!r}; "
                                  f"its inputs: {sorted(known) or 'none'}")
        for inp in stype.inputs:
            given = spec.inputs.get(inp.name)
            if given is None:
                if inp.required:
                    raise RecipeError(f"{where}.inputs.{inp.name}: required (name the earlier stage(s) whose output it takes)")
                continue
            names = given if isinstance(given, list) else [given]
            if not inp.many and isinstance(given, list):
                raise RecipeError(f"{where}.inputs.{inp.name}: takes one stage name, got a list {given}")
            for n in names:
                if n not in produced:
                    later = n in {s.name for s in recipe.stages}
                    raise RecipeError(
                        f"{where}.inputs.{inp.name}: {n!r} is not an earlier stage"
                        + (" (it runs later; reorder the stages)" if later else "")
                        + f"; earlier stages: {list(produced) or 'none'}"
                    )
                if produced[n] not in inp.accepts:
                    raise RecipeError(f"{where}.inputs.{inp.name}: stage {n!r} outputs a checkpoint of kind {produced[n]!r}, "
                                      f"but {inp.name} takes {' or '.join(map(repr, inp.accepts))}")
        output = _output_kind(spec, config, types)
        out.stages.append(PlannedStage(spec, config, output))
        produced[spec.name] = output
        types[spec.name] = spec.stage
    return out


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else PROJECT_ROOT / p


def _load_stage_config(stype: StageType, spec: StageSpec, overrides: dict[str, Any], output_root: str, where: str) -> BaseModel:
    cls = load_target(stype.config)
    data: dict[str, Any] = {}
    src = f"{where} (defaults of {stype.config})"
    if spec.recipe:
        try:
            data, _ = read_recipe(_resolve(spec.recipe))
        except RecipeError as e:
            raise RecipeError(f"{where}.recipe: {e}") from None
        src = f"{where} recipe {spec.recipe}"
    data["output_root"] = output_root  # the pipeline decides where its runs go (an override may still say otherwise)
    try:
        for key, value in overrides.items():
            set_dotted(data, key, value)
    except RecipeError as e:
        raise RecipeError(f"{where}.overrides: {e}") from None
    return validate(cls, data, src)


def _output_kind(spec: StageSpec, config: BaseModel, types: dict[str, str]) -> str:
    lora = getattr(config, "lora", None)
    if lora is not None and lora.enabled:
        return ADAPTER
    if spec.stage == "lora_merge":  # merging a reward-model adapter gives a reward model
        return REWARD if types[str(spec.inputs["adapter"])] == "reward_model" else POLICY
    return STAGES[spec.stage].output
