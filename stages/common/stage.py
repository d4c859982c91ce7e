"""What a stage is to the rest of the project: its spec, declared beside it, and one run's identity.

A stage module ends with ``SPEC = StageSpec(...)``: its config class, its function, its inputs (the
checkpoint kinds each takes, and the config field a CLI run reads it from), its output kind and the
config fields that name files. ``stages/registry.py`` lists the specs by name; the pipeline, the flow
and the nightly validation know a stage only through its spec.

:class:`StageRun` is the identity of one run of a stage, computed once (:meth:`StageSpec.identify`)
from everything that decides what the run computes:

- the stage's name and its canonical config, less where runs go (``output_root``), the fields that
  name its inputs (their digests count instead) and the settings that only change how a run is
  watched, bounded or continued (``train.resume``, ``train.progress_bar``, ``train.logging_steps``, the
  deadlines and retries, ``train.keep_last``);
- the content digests of its input checkpoints;
- the content digest of every local file or folder its config names (``StageSpec.files``); for a file of user code
  (``StageSpec.plugins``: a reward function, an agent, a grader), of it and the modules it imports from its own
  folder tree (``identity.plugin_files``);
- its code version: the sha256 of the source files in the import closure of the stage's modules
  within the project (``modulefinder``: imports inside functions count), so any edit to code the
  stage can run changes it, and nothing has to be listed by hand.

``StageRun.key`` names the run folder (``<output_root>/<key>/``: checkpoint, in-stage state, metrics,
logs) and is the flow's Prefect cache key, so a CLI run and a flow run of the same thing share a
folder, and in-stage resume only ever finds state written under the same identity (the folder's
``identity.json`` must name it too). This is the one place that decides whether a stage reruns.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from checkpoints import CheckpointRef, path_digest
from stages.common.identity import (  # noqa: F401  (re-exported: what a stage module needs of an identity)
    NOT_IN_IDENTITY,
    PROJECT_ROOT,
    RunBusy,
    StageRun,
    canonical_config,
    code_version,
    committed_checkpoint,
    get_dotted,
    import_closure,
    make_run,
    plugin_digest,
)
from stages.common.models import resolve_model

# What a stage's output is, for checking a pipeline's wiring before anything runs.
POLICY = "policy"  # a full causal LM
REWARD = "reward"  # a full reward model
ADAPTER = "adapter"  # LoRA weights on a causal LM
REWARD_ADAPTER = "reward_adapter"  # LoRA weights (and head) on a reward model
REPORT = "report"  # eval's report; never an input

InputValue = CheckpointRef | Mapping[str, CheckpointRef] | None


@dataclass(frozen=True)
class Logged:
    """The metrics a run of a stage can be gated on (``flows.gates.stage_metrics``: the last ``metrics.jsonl`` row and
    the numbers of the manifest's ``extra``), declared by the stage so that a pipeline's gates and ``save_best`` are
    checked against them at planning. ``open``: what adds names only a run knows (an agent's info, a reward endpoint's
    ``extra_logs``), or None: the names are all there are."""

    names: frozenset[str]
    open: str | None = None


def logged(*groups: Any, open: str | None = None) -> Logged:  # noqa: A002  (the field's name)
    return Logged(frozenset(n for g in groups for n in ([g] if isinstance(g, str) else g)), open)


def unknown_metric(declared: Logged, name: str, what: str, stage: str) -> None:
    """A RecipeError naming ``what`` when ``name`` is not a metric the stage (``stage``: how to name it) logs, with a
    "did you mean" and the names it does log; a stage whose names are open (``Logged.open``) accepts any name."""
    if name in declared.names or declared.open:
        return
    from stages.common.cli import did_you_mean
    from stages.common.recipe import RecipeError

    raise RecipeError(f"{what}: {stage} logs no metric {name!r}{did_you_mean(name, declared.names)} "
                      f"(it logs: {', '.join(sorted(declared.names)) or 'none'})")


@dataclass(frozen=True)
class Input:
    """One input of a stage: a checkpoint (or, with ``many``, checkpoints labelled by name)."""

    name: str
    accepts: tuple[str, ...]  # the output kinds it takes
    field: str | None = None  # the config field holding its model spec(s) for CLI runs (and unwired pipeline inputs)
    required: bool = False  # a pipeline must wire it to earlier stage(s)
    many: bool = False  # a list of stages; the stage gets {stage name: ref}
    # whether this config uses the input at all (e.g. the RL critic's start, only for estimators with a critic);
    # an unused input is handed to the stage as None and is not part of the run's identity
    needed: Callable[[BaseModel], bool] | None = None

    def used_by(self, config: BaseModel) -> bool:
        return self.needed is None or bool(self.needed(config))


def trained_output(full: str, adapter: str) -> Callable[[BaseModel, Mapping[str, Any]], str]:
    """The output kind of a training stage: ``adapter`` with LoRA on, else ``full``."""
    return lambda config, inputs: adapter if config.lora.enabled else full


@dataclass(frozen=True)
class StageSpec:
    name: str
    config: type[BaseModel]
    run: Callable[..., Any]  # run(config, **inputs, run=StageRun | None) -> result
    inputs: tuple[Input, ...] = ()
    # the output's kind, or a function of (config, {input name: kind(s) wired to it}) giving it
    output: str | Callable[[BaseModel, Mapping[str, Any]], str] = POLICY
    files: tuple[str, ...] = ()  # dotted config fields naming local files or folders (a string or a list)
    plugins: tuple[str, ...] = ()  # those of ``files`` that may name code as ``file.py:name`` or ``module:name``
    result: type[BaseModel] = CheckpointRef
    existing: Callable[[StageRun], Any] = committed_checkpoint  # a finished output under an identity, or None
    # the stage's own checks of what its config names, run before any process starts (code that must import, a
    # server that must accept connections); raise the project's errors (PluginError, RecipeError, ...)
    check: Callable[[BaseModel], None] | None = None
    # the metrics a run of this config logs (gates and save_best are checked against them at planning)
    metrics: Callable[[BaseModel], Logged] = lambda config: Logged(frozenset())

    def preflight(self, config: BaseModel) -> None:
        """What a config names that can be checked before any process starts (the CLI and a pipeline's plan run
        this): every local data file exists, and the stage's own :attr:`check`."""
        from datasets_prep.loading import check_path

        for dotted in self.files:
            if dotted in self.plugins:
                continue
            value = get_dotted(config, dotted)
            for item in [value] if isinstance(value, str) else value or []:
                check_path(item, dotted)
        if self.check is not None:
            self.check(config)
        best = get_dotted(config, "train.save_best.metric")
        if best:
            unknown_metric(self.metrics(config), best, f"train.save_best.metric: {best!r}", f"the {self.name} stage")

    def output_kind(self, config: BaseModel, input_kinds: Mapping[str, Any]) -> str:
        return self.output(config, input_kinds) if callable(self.output) else self.output

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules its code starts from (a module run as ``python -m`` by its real name)."""
        return tuple(dict.fromkeys(_module_name(x) for x in (self.run, self.config)))

    def identify(self, config: BaseModel, inputs: Mapping[str, InputValue], given: StageRun | None = None) -> StageRun:
        """The run's identity: ``given`` (a flow passes the one it computed) after checking it is this
        config's and these inputs', else computed here."""
        parts = {"config": canonical_config(config, tuple(i.field for i in self.inputs if i.field)),
                 "inputs": _input_digests(self, config, inputs)}
        if given is not None:
            if given.stage != self.name or any(given.parts[k] != v for k, v in parts.items()):
                raise ValueError(f"{self.name}: the run identity {given.key} was computed for another config or other inputs")
            return given
        parts["files"] = self.file_digests(config)
        parts["code"] = code_version(self.modules)
        return make_run(self.name, parts, config.output_root)

    def file_digests(self, config: BaseModel) -> dict[str, str]:
        """Content digest of every local file or folder the config names; a hub dataset id in a data section's
        ``paths``: the commit its ``revision`` resolves to (``hub:<sha>``), so a dataset changed upstream is a new
        identity (offline, from the local Hugging Face cache; neither: a DataError naming the id)."""
        from datasets_prep.loading import hub_revision, is_hub_id
        from stages.common.plugins import source_file

        found: dict[str, str] = {}
        for dotted in self.files:
            value = get_dotted(config, dotted)
            for item in [value] if isinstance(value, str) else value or []:
                if item in found or item in ("", "."):
                    continue
                if dotted in self.plugins:  # file.py, file.py:name, module:name: the file and what it imports
                    src = source_file(item)
                    if src is not None:
                        found[item] = "code:" + plugin_digest(src)
                elif os.path.exists(item):
                    found[item] = path_digest(item)
                elif dotted.endswith(".paths") and is_hub_id(item):
                    found[item] = "hub:" + hub_revision(item, get_dotted(config, dotted.rsplit(".", 1)[0] + ".revision"))
        return found

    def resolve_inputs(self, config: BaseModel, given: Mapping[str, InputValue]) -> dict[str, InputValue]:
        """``given`` plus, for each input not given, the model(s) its config field names (None if empty)."""
        out = dict(given)
        for inp in self.inputs:
            if not inp.used_by(config):
                out[inp.name] = None
                continue
            if out.get(inp.name) or not inp.field:
                out.setdefault(inp.name, None)
                continue
            spec = get_dotted(config, inp.field)
            if not spec:
                out[inp.name] = None
            elif inp.many:
                refs = [resolve_model(s, config.output_root) for s in spec]
                out[inp.name] = {f"{r.stage}:{r.digest[:8]}": r for r in refs}
            else:
                out[inp.name] = resolve_model(spec, config.output_root)
        return out

    def dump_inputs(self, inputs: Mapping[str, InputValue]) -> dict[str, Any]:
        return {k: None if v is None else v.model_dump() if isinstance(v, CheckpointRef)
                else {label: r.model_dump() for label, r in v.items()} for k, v in inputs.items()}

    def load_inputs(self, data: Mapping[str, Any]) -> dict[str, InputValue]:
        many = {i.name for i in self.inputs if i.many}
        return {k: None if v is None else {label: CheckpointRef.model_validate(r) for label, r in v.items()} if k in many
                else CheckpointRef.model_validate(v) for k, v in data.items()}


def _module_name(obj: Any) -> str:
    name = obj.__module__
    main_spec = getattr(sys.modules.get(name), "__spec__", None) if name == "__main__" else None
    return main_spec.name if main_spec is not None else name


def _input_digests(spec: StageSpec, config: BaseModel, inputs: Mapping[str, InputValue]) -> dict[str, Any]:
    known = {i.name for i in spec.inputs}
    unused = {i.name for i in spec.inputs if not i.used_by(config)}
    unknown = set(inputs) - known
    if unknown:
        raise ValueError(f"{spec.name}: no inputs named {sorted(unknown)}; its inputs: {sorted(known)}")
    out: dict[str, Any] = {}
    for name in sorted(known):
        v = None if name in unused else inputs.get(name)
        # a labelled list keeps its order and labels (eval's report rows)
        out[name] = None if v is None else v.digest if isinstance(v, CheckpointRef) else [[k, r.digest] for k, r in v.items()]
    return out


def unchanged_inputs(result: Any, inputs: Mapping[str, InputValue]) -> list[str]:
    """The inputs whose content digest the output checkpoint has: training left the weights as they were."""
    if not isinstance(result, CheckpointRef):
        return []
    return [name for name, ref in inputs.items() if isinstance(ref, CheckpointRef) and ref.digest == result.digest]


def warn_if_unchanged(label: str, result: Any, inputs: Mapping[str, InputValue], file: Any = None) -> None:
    """Say so when the output is one of its inputs (``file``: default stderr, beside a CLI's JSON on stdout)."""
    for name in unchanged_inputs(result, inputs):
        print(f"[{label}] WARNING: the output checkpoint has the same content digest as its input {name!r} "
              f"({result.digest[:16]}): this run did not change the weights", file=file or sys.stderr, flush=True)


def cli_run(spec: StageSpec, argv: list[str] | None = None) -> Any:
    """A stage's CLI: ``[RECIPE.yaml] [key=value ...] [--refresh] [--debug] [--help [FIELD]]``; inputs from their
    config fields; the result. A run folder that already holds a verified output of the same identity (a flow's, an
    earlier CLI run's) is the result at once, said on stderr; ``--refresh`` trains again (the folder's record is
    replaced only when the new output commits). A mistake in what was given is one line on stderr (exit code 2)."""
    from stages.common.cli import run_cli

    prog = f"python -m stages.{spec.name}"  # every stage's command is its name under stages/
    argv = list(sys.argv[1:] if argv is None else argv)
    refresh = "--refresh" in argv
    argv = [a for a in argv if a != "--refresh"]
    return run_cli(prog, argv, lambda args: _cli_body(spec, args, refresh), spec.config)


def _cli_body(spec: StageSpec, argv: list[str], refresh: bool = False) -> Any:
    from stages.common.recipe import RecipeError, load_config

    config = load_config(spec.config, argv)
    spec.preflight(config)
    inputs = spec.resolve_inputs(config, {})
    for inp in spec.inputs:
        if inp.required and not inputs[inp.name]:
            raise RecipeError(f"{inp.field}: required: the {spec.name} stage needs {inp.name} (e.g. {inp.field}=runs/<folder>)")
    run = spec.identify(config, inputs)
    existing = None if refresh else spec.existing(run)
    if existing is not None:
        print(f"[{spec.name}] {run.run_dir} already holds this run's output (same identity): "
              f"{getattr(existing, 'path', None) or existing.markdown}; not rerun (--refresh trains again)", file=sys.stderr)
        return existing
    result = spec.run(config, **inputs, run=run)
    warn_if_unchanged(spec.name, result, inputs)
    return result


def print_result(spec: StageSpec, argv: list[str] | None = None) -> None:
    """The ``main()`` of a stage whose result is a checkpoint: run it from the CLI, print the reference."""
    print(cli_run(spec, argv).model_dump_json(indent=2))
