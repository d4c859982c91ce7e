"""Every field of every stage's config is read by the stage's code or refused by name (no setting accepted and
ignored), and every field says what it is (``--help``)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from stages import registry
from stages.common.cli import config_help, model_of
from stages.common.identity import import_closure
from stages.common.recipe import RecipeError, validate


def fields(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    """(dotted path as a tuple of attribute names, the model holding the field, whether it is a section)."""
    for name, info in model.model_fields.items():
        sub = model_of(info.annotation)
        yield (*prefix, name), model, sub is not None
        if sub is not None:
            yield from fields(sub, (*prefix, name))


class Reads(ast.NodeVisitor):
    """What a source file reads: ``x.attr`` pairs (x: a name, or the attribute the base ends with), the names bound to
    a config section (``ro = cfg.rollout``) or annotated with a config class (``def f(train: TrainConfig)``), and
    its string constants (``get_dotted(config, "data.paths")``)."""

    def __init__(self):
        self.pairs: set[tuple[str, str]] = set()
        self.aliases: dict[str, set[str]] = {}  # a local name -> the section attributes / classes it was bound to
        self.strings: set[str] = set()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = node.value
        key = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else "?"
        self.pairs.add((key, node.attr))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        targets = [t for t in node.targets if isinstance(t, ast.Name)]
        values = [node.value]
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
            targets, values = list(node.targets[0].elts), list(node.value.elts)
        for t, v in zip(targets, values * (len(targets) if len(values) == 1 else 1), strict=False):
            if isinstance(t, ast.Name) and isinstance(v, ast.Attribute):
                self.aliases.setdefault(t.id, set()).add(v.attr)
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        if node.annotation is not None:
            for n in ast.walk(node.annotation):
                name = n.id if isinstance(n, ast.Name) else n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
                if name:
                    self.aliases.setdefault(node.arg, set()).update(x.strip() for x in name.replace("|", " ").split())
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self.strings.add(node.value)


@functools.cache
def reads_of(path: Path) -> Reads:
    r = Reads()
    r.visit(ast.parse(path.read_text()))
    return r


def read_somewhere(path: tuple[str, ...], holder: type[BaseModel], files: list[Path]) -> bool:
    """Whether code in ``files`` reads the field: ``<section>.<leaf>``, ``<alias of the section>.<leaf>``,
    ``<name annotated with the holder's class>.<leaf>`` or the dotted path as a string; a top-level field: any
    ``x.<leaf>``."""
    leaf, section = path[-1], path[-2] if len(path) > 1 else None
    dotted = ".".join(path)
    for f in files:
        r = reads_of(f)
        if any(s == dotted or s.endswith("." + dotted) or (section and s.endswith(f"{section}.{leaf}")) for s in r.strings):
            return True
        if section is None:
            if any(attr == leaf for _, attr in r.pairs):
                return True
            continue
        names = {section} | {n for n, bound in r.aliases.items() if section in bound or holder.__name__ in bound}
        if any((n, leaf) in r.pairs for n in names):
            return True
    return False


def stage_files(spec) -> list[Path]:
    files: set[Path] = set()
    for module in spec.modules:
        files |= set(import_closure(module))
    return sorted(files)


@pytest.mark.parametrize("stage", sorted(registry.STAGES))
def test_every_field_is_read_by_the_stage_or_refused_by_name(stage):
    spec = registry.spec(stage)
    unused = getattr(spec.config, "UNUSED", {})
    files = stage_files(spec)
    unread = []
    for path, holder, section in fields(spec.config):
        dotted = ".".join(path)
        if section or dotted in unused or any(dotted.startswith(u + ".") for u in unused):
            continue
        if not read_somewhere(path, holder, files):
            unread.append(dotted)
    assert not unread, f"{stage}: fields no code of the stage reads (read them, or list them in {spec.config.__name__}.UNUSED): {unread}"
    for dotted, instead in unused.items():  # each refused by name, with what to use instead
        data: dict = {}
        node = data
        *sections, leaf = dotted.split(".")
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = "given"
        with pytest.raises(RecipeError, match=re.escape(f"{dotted}: 'given': this stage does not read it; {instead}")):
            validate(spec.config, data, "r.yaml")


def test_rl_refuses_the_training_settings_it_does_not_use_and_names_the_one_it_does():
    from stages.rl.config import RLConfig

    data = {"data": {"paths": ["p.jsonl"]}}
    with pytest.raises(RecipeError, match=r"train\.max_steps: 2: this stage does not read it; RL steps are max_steps \(top level\)"):
        validate(RLConfig, {**data, "train": {"max_steps": 2}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"train\.num_epochs: .*algo\.ppo_epochs"):
        validate(RLConfig, {**data, "train": {"num_epochs": 2}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"data\.packing: True: this stage does not read it; prompts are not packed"):
        validate(RLConfig, {"data": {"paths": ["p.jsonl"], "packing": True}}, "r.yaml")
    assert validate(RLConfig, {**data, "max_steps": 2}, "r.yaml").max_steps == 2
    # its default passes: a config written out whole (a rank's job file) validates again as it was
    cfg = validate(RLConfig, {**data, "max_steps": 2}, "r.yaml")
    assert validate(RLConfig, cfg.model_dump(mode="json", by_alias=True), "job.json") == cfg


@pytest.mark.parametrize("stage", sorted(registry.STAGES))
def test_every_field_has_a_description_and_help_lists_it(stage):
    config = registry.spec(stage).config
    unused = getattr(config, "UNUSED", {})
    text = config_help(config)
    missing = []
    for dotted in unused:  # the tree leaves the refused fields out
        section, _, leaf = dotted.rpartition(".")
        assert not re.search(rf"(?m)^{section}\b.*\n(?:  .*\n)*?  {leaf} \(", text + "\n"), dotted
    for path, holder, section in fields(config):
        dotted = ".".join(path)
        info = holder.model_fields[path[-1]]
        if dotted in unused:
            continue
        sub = model_of(info.annotation)
        if not info.description and not (section and sub.__doc__):
            missing.append(dotted)
    assert not missing, f"{stage}: fields without a description: {missing}"
