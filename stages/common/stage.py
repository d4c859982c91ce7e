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
- the content digest of every local file or folder its config names (``StageSpec.files``);
- its code version: the sha256 of the source files in the import closure of the stage's modules
  within the project (``modulefinder``: imports inside functions count), so any edit to code the
  stage can run changes it, and nothing has to be listed by hand.

``StageRun.key`` names the run folder (``<output_root>/<key>/``: checkpoint, in-stage state, metrics,
logs) and is the flow's Prefect cache key, so a CLI run and a flow run of the same thing share a
folder, and in-stage resume only ever finds state written under the same identity (the folder's
``identity.json`` must name it too). This is the one place that decides whether a stage reruns.
"""

from __future__ import annotations

import functools
import hashlib
import json
import modulefinder
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from checkpoints import CheckpointRef, load_ref, path_digest, read_manifest, sha256_file
from checkpoints.store import CheckpointError, content_digest

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# What a stage's output is, for checking a pipeline's wiring before anything runs.
POLICY = "policy"  # a full causal LM
REWARD = "reward"  # a full reward model
ADAPTER = "adapter"  # LoRA weights on a causal LM
REWARD_ADAPTER = "reward_adapter"  # LoRA weights (and head) on a reward model
REPORT = "report"  # eval's report; never an input

# settings that change how a run is watched or continued, not what it computes
NOT_IN_IDENTITY = ("train.resume", "train.progress_bar", "train.logging_steps", "train.keep_last", "train.timeout_s", "logging",
                   "timeout_s", "ray.call_timeout_s", "ray.startup_timeout_s", "reward.timeout_s", "reward.retries",
                   "verify_sync", "sync_tolerance", "sync_min_prob")
IDENTITY_FILE = "identity.json"
LOCK_FILE = ".lock"

InputValue = CheckpointRef | Mapping[str, CheckpointRef] | None


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


def committed_checkpoint(run: StageRun) -> CheckpointRef | None:
    """The checkpoint committed under ``run``'s identity, if its folder holds one that verifies."""
    dest = run.run_dir / "checkpoint"
    try:
        if read_manifest(dest).config_hash != run.key:
            return None
        return load_ref(dest)
    except CheckpointError:
        return None


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

    def output_kind(self, config: BaseModel, input_kinds: Mapping[str, Any]) -> str:
        return self.output(config, input_kinds) if callable(self.output) else self.output

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules its code starts from (a module run as ``python -m`` by its real name)."""
        return tuple(dict.fromkeys(_module_name(x) for x in (self.run, self.config)))

    def identify(self, config: BaseModel, inputs: Mapping[str, InputValue], given: StageRun | None = None) -> StageRun:
        """The run's identity: ``given`` (a flow passes the one it computed) after checking it is this
        config's and these inputs', else computed here."""
        parts = {"config": self._canonical_config(config), "inputs": _input_digests(self, config, inputs)}
        if given is not None:
            if given.stage != self.name or any(given.parts[k] != v for k, v in parts.items()):
                raise ValueError(f"{self.name}: the run identity {given.key} was computed for another config or other inputs")
            return given
        parts["files"] = self.file_digests(config)
        parts["code"] = code_version(self.modules)
        blob = json.dumps({"stage": self.name, **parts}, sort_keys=True, separators=(",", ":"))
        return StageRun(stage=self.name, key=f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}",
                        output_root=str(config.output_root), parts=parts)

    def _canonical_config(self, config: BaseModel) -> dict[str, Any]:
        data = config.model_dump(mode="json")
        for dotted in ("output_root", *NOT_IN_IDENTITY, *(i.field for i in self.inputs if i.field)):
            *head, last = dotted.split(".")
            node = data
            for part in head:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(last, None)
        return data

    def file_digests(self, config: BaseModel) -> dict[str, str]:
        """Content digest of every local file or folder the config names (a hub id names none)."""
        found: dict[str, str] = {}
        for dotted in self.files:
            value = get_dotted(config, dotted)
            for item in [value] if isinstance(value, str) else value or []:
                if item not in found and item not in ("", ".") and os.path.exists(item):
                    found[item] = path_digest(item)
                elif item and dotted in self.plugins and item not in found:  # file.py:name, module:name
                    from stages.common.plugins import source_file

                    src = source_file(item)
                    if src is not None:
                        found[item] = path_digest(src)
        return found

    def resolve_inputs(self, config: BaseModel, given: Mapping[str, InputValue]) -> dict[str, InputValue]:
        """``given`` plus, for each input not given, the model(s) its config field names (None if empty)."""
        from stages.common.models import resolve_model

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


class RunBusy(RuntimeError):
    """Another process holds the run folder's lock."""


class StageRun(BaseModel):
    """One run's identity (see the module docstring): its key names the run folder and the cache entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str
    key: str
    output_root: str
    parts: dict[str, Any]  # what the key hashes: config, inputs, files, code

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.key

    def prepare(self) -> Path:
        """Create the run folder; refuse one that another identity wrote (``identity.json``)."""
        folder = self.run_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / IDENTITY_FILE
        if path.is_file():
            try:
                found = json.loads(path.read_text()).get("key")
            except ValueError:
                found = None
            if found != self.key:
                raise CheckpointError(f"{folder}: holds a run of identity {found!r}, not {self.key!r}; "
                                      "its state and checkpoint are not this run's (remove the folder or use another output_root)")
            return folder
        tmp = folder / f".{IDENTITY_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"key": self.key, "stage": self.stage, **self.parts}, indent=1, sort_keys=True))
        tmp.replace(path)
        return folder

    @contextmanager
    def claimed(self) -> Iterator[Path]:
        """:meth:`prepare`, then hold the run folder's lock (``.lock``, an flock) for the block: a second
        process writing the same run (two flows, a flow and a CLI run) is refused, naming the holder."""
        import fcntl

        folder = self.prepare()
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunBusy(f"{folder}: another process (pid {holder}) is writing this run; wait for it to end or stop it") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield folder
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _module_name(obj: Any) -> str:
    name = obj.__module__
    main_spec = getattr(sys.modules.get(name), "__spec__", None) if name == "__main__" else None
    return main_spec.name if main_spec is not None else name


def get_dotted(config: BaseModel | Mapping[str, Any] | None, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return node


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


@functools.cache
def import_closure(module: str, root: Path = PROJECT_ROOT) -> tuple[Path, ...]:
    """The project's source files that ``module`` imports, directly or through others (sorted)."""
    finder = modulefinder.ModuleFinder(path=[str(root)])  # modules outside the project are not followed
    finder.import_hook(module)
    if module not in finder.modules:
        raise ImportError(f"{module}: not a module under {root}")
    files = {Path(m.__file__).resolve() for m in finder.modules.values() if m.__file__}
    return tuple(sorted(f for f in files if f.is_relative_to(root.resolve())))


def code_version(modules: tuple[str, ...], root: Path | None = None) -> str:
    """sha256 over the (relative path, contents) of every project file the modules' import closure holds."""
    root = PROJECT_ROOT if root is None else root
    files = sorted({f for m in modules for f in import_closure(m, root)})
    return content_digest({f.relative_to(root.resolve()).as_posix(): sha256_file(f) for f in files})


def cli_run(spec: StageSpec, argv: list[str] | None = None) -> Any:
    """A stage's CLI: ``[RECIPE.yaml] [key=value ...]``; inputs from their config fields; the result."""
    from stages.common.recipe import RecipeError, load_config

    config = load_config(spec.config, argv)
    inputs = spec.resolve_inputs(config, {})
    for inp in spec.inputs:
        if inp.required and not inputs[inp.name]:
            raise RecipeError(f"{inp.field}: required: the {spec.name} stage needs {inp.name} (e.g. {inp.field}=runs/<folder>)")
    return spec.run(config, **inputs)


def print_result(spec: StageSpec, argv: list[str] | None = None) -> None:
    """The ``main()`` of a stage whose result is a checkpoint: run it from the CLI, print the reference."""
    print(cli_run(spec, argv).model_dump_json(indent=2))
