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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flows.sweeps import SweepConfig
from stages import registry
from stages.common.cli import did_you_mean
from stages.common.recipe import (
    RecipeError,
    format_validation_error,
    read_recipe,
    read_yaml,
    set_dotted,
    validate,
)
from stages.common.stage import PROJECT_ROOT, StageRun, StageSpec

__all__ = ["PROJECT_ROOT", "Plan", "PlannedStage", "PipelineRecipe", "StagePlan", "plan", "plan_data"]


class StagePlan(BaseModel):
    """One entry of a pipeline recipe's ``stages``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$")
    stage: str
    recipe: str | None = Field(None, description="the stage recipe (YAML); None: the config's defaults")
    overrides: dict[str, Any] = Field({}, description="dotted keys -> values, applied over the recipe")
    inputs: dict[str, str | list[str]] = Field({}, description="input name -> earlier stage name(s)")
    retries: int = Field(0, ge=0)
    retry_delay_seconds: float = Field(10.0, ge=0)
    work_pool: str | None = Field(None, description="run this stage as a flow run of the deployment run-stage/<work_pool> on that Prefect work pool (python -m flows.stage_flow deploy POOL), the pipeline waiting for it; None: in the pipeline's own process. Not part of the stage's identity")
    job_variables: dict[str, Any] = Field({}, description="with work_pool: the flow run's job variables (e.g. {env: {CUDA_VISIBLE_DEVICES: \"0\"}})")
    gates: list[str] = Field([], description="conditions on metrics the run must meet, e.g. 'rl.eval_accuracy >= sft.eval_accuracy + 0.05' or 'eval.rl.accuracy >= 0.2' (flows/gates.py); a failing one fails the flow run, its checkpoints kept")
    timeout_s: float | None = Field(None, gt=0, description="deadline of one attempt of the stage (its subprocess and everything it started); past it the process tree is ended and the attempt fails (then retried if retries are left). None: no deadline")


class PipelineRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the pipeline's name (the deployment's, e.g. full-rlhf/tiny)")
    output_root: str = Field("runs", description="every stage's run folders go under it (overrides the stage recipes' output_root)")
    cluster: dict[str, Any] = Field({}, description="every training stage's ``cluster`` section (e.g. {address: \"ray-head:6379\"}: the whole pipeline on an existing Ray cluster); a stage's own overrides still win. Not part of any run's identity")
    stages: list[StagePlan] = Field(min_length=1, description="the stages in the order they run")
    sweep: SweepConfig | None = Field(None, description="variants of some stages from the same upstream stages: {grid: {rl.algo.advantage_estimator: [group_norm, rloo]}} or {variants: [...]} (flows/sweeps.py)")


@dataclass
class PlannedStage:
    spec: StagePlan
    stage: StageSpec  # the stage type's own spec (stages.registry)
    config: BaseModel
    output: str  # the kind of its output (stages.common.stage: POLICY, REWARD, ADAPTER, ...)

    def identify(self, outputs: dict[str, Any]) -> tuple[dict[str, Any], StageRun]:
        """This stage's inputs, from the earlier stages' ``outputs`` it is wired to (unwired ones: the
        model their config field names), and its run identity."""
        wired = {k: ({n: outputs[n] for n in v} if isinstance(v, list) else outputs[v]) for k, v in self.spec.inputs.items()}
        inputs = self.stage.resolve_inputs(self.config, wired)
        return inputs, self.stage.identify(self.config, inputs)


@dataclass
class Plan:
    recipe: PipelineRecipe
    stages: list[PlannedStage] = field(default_factory=list)
    gates: list = field(default_factory=list)  # flows.gates.Gate, every stage's, in stage order
    variants: list[dict[str, Any]] = field(default_factory=list)  # a sweep's (flows.sweeps.expand)
    select: Any = None  # a sweep's flows.sweeps.SelectConfig: what names the best variant (None: nothing does)


def plan(source: str | Path, output_root: str | None = None, stage_overrides: dict[str, dict[str, Any]] | None = None,
         cluster_address: str | None = None) -> Plan:
    """Read and check a pipeline recipe and every stage recipe in it; nothing runs. ``cluster_address``: every
    training stage on the Ray cluster there (the recipe's ``cluster.address``)."""
    source = str(source)
    return plan_data(read_yaml(_resolve(source)), source, output_root, stage_overrides, cluster_address)


def plan_data(data: dict[str, Any], source: str, output_root: str | None = None,
              stage_overrides: dict[str, dict[str, Any]] | None = None, cluster_address: str | None = None) -> Plan:
    """:func:`plan` of a pipeline recipe already read (``source`` names it in errors)."""
    recipe = _recipe(data, source, output_root, cluster_address)
    _check_override_names(recipe, stage_overrides or {}, source)
    out = Plan(recipe)
    original = recipe
    if recipe.sweep is not None:
        from flows.sweeps import expand

        stages, out.variants = expand(recipe.stages, recipe.sweep, source)
        out.recipe = recipe = recipe.model_copy(update={"stages": stages})
    copied_from = {copy: original for v in out.variants for original, copy in v["stages"].items()}
    produced: dict[str, str] = {}  # stage name -> output kind
    for i, spec in enumerate(recipe.stages):
        given = stage_overrides or {}  # a swept stage's copies take the overrides given for it by its own name
        overrides = {**spec.overrides, **(given.get(spec.name) or given.get(copied_from.get(spec.name, "")) or {})}
        planned = _plan_stage(spec, overrides, recipe, produced, f"{source}: stages[{i}] ({spec.name})")
        out.stages.append(planned)
        produced[spec.name] = planned.output
    out.gates = _plan_gates(out.stages, source)
    if out.variants:
        out.select = _plan_select(original, out, source)
    return out


def _plan_select(original: PipelineRecipe, p: Plan, source: str):
    """The sweep's selection metric (``sweep.select``, else the first gate's left side), checked: a metric its stage
    logs, of a stage the sweep copies (a stage shared by every variant can't tell them apart)."""
    from flows.gates import parse
    from flows.sweeps import renamed_ref, result_of, selection

    types = {s.name: s.stage for s in original.stages}
    first = [parse(text, s.name, types) for s in original.stages for text in s.gates][:1]
    select = selection(original.sweep, first)
    if select is None:
        return None
    where = f"{source}: sweep.select.metric {select.metric!r}"
    variant = p.variants[0]
    try:
        gate = parse(f"{select.metric} >= 0", "sweep", types)
    except RecipeError as e:
        raise RecipeError(f"{source}: sweep.select.metric: {e}") from None
    if result_of(select, variant) == result_of(select, {"stages": {}}):
        raise RecipeError(f"{where}: names stage {result_of(select, variant)!r}, which the sweep does not copy (every variant "
                          f"shares it); name a swept stage or one downstream of it (copied: {', '.join(variant['stages'])})")
    _check_metric(renamed_ref(gate.left, variant), {s.spec.name: s for s in p.stages}, where)
    return select


def _recipe(data: dict[str, Any], source: str, output_root: str | None, cluster_address: str | None) -> PipelineRecipe:
    """The pipeline recipe, with the command line's output root and cluster address over its own."""
    if output_root is not None:
        data["output_root"] = output_root
    if cluster_address:
        data["cluster"] = {**(data.get("cluster") or {}), "address": cluster_address}
    try:
        return PipelineRecipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, source, PipelineRecipe)) from None


def _check_override_names(recipe: PipelineRecipe, stage_overrides: dict[str, Any], source: str) -> None:
    unknown = set(stage_overrides) - {s.name for s in recipe.stages}
    if unknown:
        names = [s.name for s in recipe.stages]
        hint = "".join(did_you_mean(u, names) for u in sorted(unknown))
        raise RecipeError(f"{source}: overrides for stages {sorted(unknown)} that the pipeline does not have{hint} "
                          f"(its stages: {names})")


def _plan_stage(spec: StagePlan, overrides: dict[str, Any], recipe: PipelineRecipe, produced: dict[str, str],
                where: str) -> PlannedStage:
    """One stage checked: its type, a unique name, its config (recipe + overrides), its files and code, its wiring."""
    if spec.stage not in registry.STAGES:
        raise RecipeError(f"{where}.stage: unknown stage {spec.stage!r}; expected one of {sorted(registry.STAGES)}")
    if spec.name in produced:
        raise RecipeError(f"{where}.name: {spec.name!r} is used by an earlier stage; stage names must be unique")
    stype = registry.spec(spec.stage)
    config = _load_stage_config(stype, spec, overrides, recipe, where)
    _preflight(stype, config, where)
    kinds = _input_kinds(stype, spec, produced, {s.name for s in recipe.stages}, where)
    return PlannedStage(spec, stype, config, stype.output_kind(config, kinds))


def _plan_gates(stages: list[PlannedStage], source: str) -> list:
    """Every stage's gates parsed, each metric they name checked against what its stage logs (an eval stage's: a
    model wired into it, and a metric of its report)."""
    from flows.gates import parse

    by_name = {s.spec.name: s for s in stages}
    types = {name: s.spec.stage for name, s in by_name.items()}
    out = []
    for i, st in enumerate(stages):
        for text in st.spec.gates:
            where = f"{source}: stages[{i}] ({st.spec.name}).gates"
            try:
                gate = parse(text, st.spec.name, types)
            except RecipeError as e:
                raise RecipeError(f"{source}: stages[{i}] ({st.spec.name}).{e}") from None
            for ref in gate.refs():
                _check_metric(ref, by_name, f"{where}: {gate.text!r}")
            out.append(gate)
    return out


def _check_metric(ref: str, stages: dict[str, PlannedStage], where: str) -> None:
    """``ref`` (``<stage>.<metric>``, ``<eval>.<model>.<metric>``) names a metric its stage declares it logs."""
    import re

    from stages.common.stage import unknown_metric

    name, *rest = ref.split(".")
    st = stages[name]
    if len(rest) == 2:  # an eval report's row: the model is a stage wired into it
        model, rest = rest[0], rest[1:]
        wired = st.spec.inputs.get("models") or []
        if wired and model not in wired:  # "did you mean" also by a sweep copy's original name (rl for rl-v0)
            close = did_you_mean(model, wired) or did_you_mean(model, {re.sub(r"-v\d+$", "", w): w for w in wired})
            raise RecipeError(f"{where}: the eval stage {name!r} reports no model {model!r}{close} (its models: {', '.join(wired)})")
    unknown_metric(st.stage.metrics(st.config), rest[0], where, f"the {st.spec.stage} stage {name!r}")


def _preflight(stype: StageSpec, config: BaseModel, where: str) -> None:
    """The stage's checks of its data files, code and servers (:meth:`StageSpec.preflight`), naming the stage."""
    from stages.common.cli import is_user_error

    try:
        stype.preflight(config)
    except Exception as e:
        if not is_user_error(e):
            raise
        raise RecipeError(f"{where}: {e}") from None


def _input_kinds(stype: StageSpec, spec: StagePlan, produced: dict[str, str], stage_names: set[str], where: str) -> dict[str, Any]:
    """The output kind(s) wired to each input of a stage, checked against what the input accepts and against the
    stages before it (``produced``: name -> output kind)."""
    known = {inp.name: inp for inp in stype.inputs}
    for name in spec.inputs:
        if name not in known:
            raise RecipeError(f"{where}.inputs.{name}: the {spec.stage} stage takes no input {name!r}; "
                              f"its inputs: {sorted(known) or 'none'}")
    kinds: dict[str, Any] = {}
    for inp in stype.inputs:
        given = spec.inputs.get(inp.name)
        if given is None:
            if inp.required:
                raise RecipeError(f"{where}.inputs.{inp.name}: required (name the earlier stage(s) whose output it takes)")
            continue
        kinds[inp.name] = _wired_kind(inp, given, produced, stage_names, f"{where}.inputs.{inp.name}")
    return kinds


def _wired_kind(inp, given: str | list[str], produced: dict[str, str], stage_names: set[str], where: str) -> Any:
    """The kind wired to ``inp`` by ``given`` (a stage name; a list of them for an input of many)."""
    names = given if isinstance(given, list) else [given]
    if not inp.many and isinstance(given, list):
        raise RecipeError(f"{where}: takes one stage name, got a list {given}")
    if inp.many and len(set(names)) != len(names):
        raise RecipeError(f"{where}: names a stage twice: {given}")
    for n in names:
        _check_wire(inp, n, produced, n in stage_names, where)
    return [produced[n] for n in names] if inp.many else produced[given]


def _check_wire(inp, name: str, produced: dict[str, str], later: bool, where: str) -> None:
    """Stage ``name`` ran before and outputs a kind the input ``inp`` takes (``later``: it is in the pipeline)."""
    if name not in produced:
        raise RecipeError(f"{where}: {name!r} is not an earlier stage" + (" (it runs later; reorder the stages)" if later else "")
                          + f"; earlier stages: {list(produced) or 'none'}")
    if produced[name] not in inp.accepts:
        raise RecipeError(f"{where}: stage {name!r} outputs a checkpoint of kind {produced[name]!r}, "
                          f"but {inp.name} takes {' or '.join(map(repr, inp.accepts))}")


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else PROJECT_ROOT / p


def _load_stage_config(stype: StageSpec, spec: StagePlan, overrides: dict[str, Any], recipe: PipelineRecipe, where: str) -> BaseModel:
    cls = stype.config
    data: dict[str, Any] = {}
    src = f"{where} (defaults of {cls.__module__}:{cls.__name__})"
    if spec.recipe:
        try:
            data, _ = read_recipe(_resolve(spec.recipe))
        except RecipeError as e:
            raise RecipeError(f"{where}.recipe: {e}") from None
        src = f"{where} recipe {spec.recipe}"
    data["output_root"] = recipe.output_root  # the pipeline decides where its runs go (an override may still say otherwise)
    if recipe.cluster and "cluster" in cls.model_fields:  # the pipeline's cluster, under the stage recipe's own settings
        data["cluster"] = {**recipe.cluster, **(data.get("cluster") or {})}
    try:
        for key, value in overrides.items():
            set_dotted(data, key, value)
    except RecipeError as e:
        raise RecipeError(f"{where}.overrides: {e}") from None
    return validate(cls, data, src)
