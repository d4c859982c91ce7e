"""Recipes: YAML files plus ``key.sub=value`` overrides, validated into a stage's pydantic config.

Every error names the recipe file, the dotted field path, the value given and what was expected.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from stages.common.errors import RecipeError  # noqa: F401  (where the stages and flows import it from)

T = TypeVar("T", bound=BaseModel)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of config fields at the top, got {type(data).__name__}")
    return data


VALIDATION_KEY = "validation"


def read_recipe(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stage recipe's config fields, and its optional ``validation:`` block (read by the nightly
    recipe validation flow only; the stage never sees it)."""
    data = read_yaml(path)
    block = data.pop(VALIDATION_KEY, None) or {}
    if not isinstance(block, dict):
        raise RecipeError(f"{path}: {VALIDATION_KEY}: expected a mapping, got {type(block).__name__}")
    return data, block


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings; values are parsed as YAML scalars/lists (``lr=1e-5``, ``x=[1,2]``)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value (e.g. train.lr=1e-5)")
        key, raw = item.split("=", 1)
        set_dotted(data, key, yaml.safe_load(raw) if raw != "" else "", item)
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any, label: str | None = None) -> None:
    """``data[a][b][c] = value`` for ``key`` ``a.b.c``, creating sections; ``label`` names it in errors."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {label or key!r}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    lines = [f"{source}: invalid config ({err.error_count()} error(s))"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<top>"
        if e["type"] == "extra_forbidden":
            hint = _unknown_key_hint(model, e["loc"]) if model is not None else ""
            lines.append(f"  {loc}: unknown key (value {e['input']!r}){hint or '; check the spelling against the stage config'}"
                         f" (the stage's --help lists its fields)")
        elif e["type"] == "missing":
            lines.append(f"  {loc}: required, not given")
        elif e["type"] == "value_error":  # the project's own checks name the field and the value themselves
            lines.append(f"  {'' if loc == '<top>' else loc + ': '}{e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e['input']!r})")
    return "\n".join(lines)


def _unknown_key_hint(model: type[BaseModel], loc: tuple) -> str:
    """A "did you mean" for an unknown key at ``loc``: the closest key of the section it sits in."""
    from stages.common.cli import did_you_mean, field_key, find_field

    current: type[BaseModel] | None = model
    if len(loc) > 1:
        try:
            current = find_field(model, ".".join(map(str, loc[:-1])))[2]
        except RecipeError:  # inside an unknown section: nothing to suggest from
            return ""
    if current is None:
        return ""
    return did_you_mean(str(loc[-1]), [field_key(n, i) for n, i in current.model_fields.items()])


def validate(cls: type[T], data: dict[str, Any], source: str) -> T:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, source, cls)) from None


def load_config(cls: type[T], argv: list[str] | None = None) -> T:
    """``[RECIPE.yaml] [key=value ...]`` -> a validated config (the CLI of every stage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    data: dict[str, Any] = {}
    source = "<defaults>"
    if argv and "=" not in argv[0]:
        source = argv.pop(0)
        data, _ = read_recipe(source)
    data = apply_overrides(data, argv)
    return validate(cls, data, source)
