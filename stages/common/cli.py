"""What every command line of the project shares: one-line errors, ``--debug``, and ``--help`` from the config.

A mistake in what the user gave (a recipe, an override, a data file, a plugin, a cluster address, an input
checkpoint) is printed as its message alone, exit code 2; ``--debug`` (or ``RLHF_DEBUG=1``) shows the
traceback too. ``--help`` prints a stage's config as a tree: every field with its type, default and
description (``Field(description=...)``), ``--help FIELD`` one section or field of it.
"""

from __future__ import annotations

import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DEBUG_ENV = "RLHF_DEBUG"


# the exceptions that say the user's input is wrong (their message is the whole story), by name: importing them
# here would make every stage's code version depend on every module that defines one
USER_ERRORS = frozenset({"RecipeError", "DataError", "PluginError", "ClusterError", "CheckpointError", "RunBusy",
                         "AgentError", "RewardError"})


def is_user_error(e: BaseException) -> bool:
    return any(c.__name__ in USER_ERRORS for c in type(e).__mro__)


def take_debug(argv: list[str]) -> bool:
    """Remove ``--debug`` from ``argv``; whether the traceback is wanted (the flag or ``RLHF_DEBUG``)."""
    flag = "--debug" in argv
    while "--debug" in argv:
        argv.remove("--debug")
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


@contextmanager
def one_line_errors(prog: str, debug: bool) -> Iterator[None]:
    """A user error leaves as ``<prog>: <message>`` on stderr with exit code 2 (its traceback with ``debug``)."""
    try:
        yield
    except Exception as e:
        if debug or not is_user_error(e):
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run_cli(prog: str, argv: list[str] | None, body: Callable[[list[str]], Any], config: type[BaseModel] | None = None) -> Any:
    """``body(argv)`` with ``--help [FIELD]`` (when ``config`` is given), ``--debug`` and one-line errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if config is not None and ("--help" in argv or "-h" in argv):
        flag = "--help" if "--help" in argv else "-h"
        at = argv.index(flag)
        field = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
        with one_line_errors(prog, take_debug(argv)):
            text = config_help(config, field)
        print(text if field else f"{usage(prog)}\n{text}")
        raise SystemExit(0)
    debug = take_debug(argv)
    with one_line_errors(prog, debug):
        return body(argv)


def usage(prog: str) -> str:
    return (f"usage: {prog} [RECIPE.yaml] [KEY=VALUE ...] [--refresh] [--debug] [--help [FIELD]]\n\n"
            "A recipe (YAML) and dotted overrides (train.lr=1e-5) give the config below; anything not given takes its\n"
            "default. Relative paths resolve against the working directory. --help FIELD shows one section "
            "(e.g. --help train).\n"
            "A run whose identity already has a committed output (from a flow or an earlier run) returns it at once;\n"
            "--refresh trains again (the folder's metrics and TensorBoard events are replaced when the new output commits).\n")


# ------------------------------------------------------------------------------------------------
# the config tree


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``X``, ``X | None``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def field_key(name: str, info: FieldInfo) -> str:
    """The key a recipe spells the field with (its alias where it has one: ``rollout.async``)."""
    return info.alias or name


def type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


_NO_VALUE = object()


def default_of(info: FieldInfo) -> Any:
    return info.get_default(call_default_factory=True) if info.default is PydanticUndefined else info.default


def default_text(info: FieldInfo, value: Any = _NO_VALUE) -> str:
    """``value``: the default the enclosing section's default instance gives (RL's train: zero_stage 3)."""
    if value is _NO_VALUE:
        if info.is_required():
            return "required"
        value = default_of(info)
    if isinstance(value, BaseModel):
        return ""
    return f"default {value!r}" if value is not None else "default null"


def field_line(key: str, info: FieldInfo, indent: int, value: Any = _NO_VALUE) -> list[str]:
    head = f"{' ' * indent}{key} ({type_name(info.annotation)}"
    d = default_text(info, value)
    head += f", {d})" if d else ")"
    if not info.description:
        return [head]
    return [head + ":"] + textwrap.wrap(info.description, 100, initial_indent=" " * (indent + 4),
                                        subsequent_indent=" " * (indent + 4))


def tree(model: type[BaseModel], indent: int = 0, prefix: str = "", hidden: frozenset[str] = frozenset(),
         defaults: BaseModel | None = None) -> list[str]:
    """The fields of ``model`` (``hidden``: dotted paths left out, a stage's unused fields; ``defaults``: the section's
    default instance, whose values are the defaults shown)."""
    lines: list[str] = []
    for name, info in model.model_fields.items():
        key = field_key(name, info)
        if prefix + key in hidden:
            continue
        sub = model_of(info.annotation)
        value = getattr(defaults, name) if defaults is not None else _NO_VALUE
        lines += field_line(key, info, indent, value)
        if sub is None:
            continue
        if sub.__doc__ and not info.description:
            lines += textwrap.wrap(" ".join(sub.__doc__.split()), 100, initial_indent=" " * (indent + 4),
                                   subsequent_indent=" " * (indent + 4))
        inner = value if value is not _NO_VALUE else default_of(info) if not info.is_required() else None
        lines += tree(sub, indent + 2, f"{prefix}{key}.", hidden, inner if isinstance(inner, BaseModel) else None)
    return lines


def find_field(model: type[BaseModel], dotted: str) -> tuple[str, FieldInfo, type[BaseModel] | None, Any]:
    """The field at ``dotted``: its info, its model when it is a section, and its default; RecipeError with a
    "did you mean" if there is none."""
    from stages.common.errors import RecipeError

    info, current, value = None, model, _NO_VALUE
    for depth, part in enumerate(dotted.split(".")):
        if current is None:
            raise RecipeError(f"--help {dotted}: {'.'.join(dotted.split('.')[:depth])} is a value, not a section")
        fields = {field_key(n, i): (n, i) for n, i in current.model_fields.items()}
        if part not in fields:
            raise RecipeError(f"--help {dotted}: no field {part!r} in {current.__name__}{did_you_mean(part, fields)}")
        name, info = fields[part]
        if isinstance(value, BaseModel):
            value = getattr(value, name)
        elif not info.is_required():
            value = default_of(info)
        else:
            value = _NO_VALUE
        current = model_of(info.annotation)
    return dotted, info, current, value


def config_help(model: type[BaseModel], dotted: str | None = None) -> str:
    """The config's fields as a tree (``dotted``: one section or field of it); the stage's unused fields left out."""
    hidden = frozenset(getattr(model, "UNUSED", {}))
    if dotted is None:
        doc = " ".join((model.__doc__ or "").split())
        return "\n".join(([*textwrap.wrap(doc, 110), ""] if doc else []) + tree(model, hidden=hidden))
    if dotted in hidden:
        from stages.common.errors import RecipeError

        raise RecipeError(f"--help {dotted}: this stage does not read it; {model.UNUSED[dotted]}")
    key, info, sub, value = find_field(model, dotted)
    lines = field_line(key, info, 0, value)
    if sub is not None:
        if sub.__doc__:
            lines += textwrap.wrap(" ".join(sub.__doc__.split()), 100, initial_indent="    ", subsequent_indent="    ")
        lines += tree(sub, 2, f"{dotted}.", hidden, value if isinstance(value, BaseModel) else None)
    return "\n".join(lines)


def did_you_mean(word: str, choices: Any, synonyms: dict[str, str] | None = None) -> str:
    """``; did you mean 'x'?`` for the closest of ``choices`` (or a known synonym's name), else ''."""
    import difflib

    if synonyms and word.lower() in synonyms:
        return f"; did you mean {synonyms[word.lower()]!r}?"
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
