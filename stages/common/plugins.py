"""User code named in a recipe: ``path/to/file.py``, ``path/to/file.py:function`` or ``package.module:function``.

One loader for reward functions (``reward.func``) and graders (``grader``, ``eval_grader``). A file is imported
from its path, its folder first on ``sys.path`` (as Python runs a script: ``import helper`` finds ``helper.py`` beside
it); a module by its dotted name (it must be importable in the stage's environment). The run identity covers the file
the reference resolves to (:func:`source_file`) and the modules it imports from its folder tree
(``stages.common.identity.plugin_files``), so editing either reruns the stage.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A reference that does not resolve to a callable; the message names the reference and why."""


def split_ref(ref: str, default_attr: str) -> tuple[str, str, bool]:
    """(file path or module name, attribute, is a file)."""
    head, sep, attr = ref.rpartition(":") if ":" in ref else (ref, "", "")
    if not sep:
        head, attr = ref, default_attr
    is_file = head.endswith(".py") or "/" in head or Path(head).is_file()
    return head, attr or default_attr, is_file


def source_file(ref: str, default_attr: str = "") -> str | None:
    """The local file a reference's code lives in (None when it does not resolve to one)."""
    head, _, is_file = split_ref(ref, default_attr)
    if is_file:
        return head if Path(head).is_file() else None
    try:
        spec = importlib.util.find_spec(head)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and Path(spec.origin).is_file() else None


def load_module(ref: str, what: str, error: type[Exception] = PluginError):
    """The module a reference's code lives in (a file imported from its path, or a module by its dotted name)."""
    head, _, is_file = split_ref(ref, "")
    if is_file:
        p = Path(head)
        if not p.is_file():
            from datasets_prep.loading import looked_for

            raise error(f"{what} {ref}: not found ({looked_for(p)})")
        import sys

        if str(p.resolve().parent) not in sys.path:
            sys.path.insert(0, str(p.resolve().parent))
        spec = importlib.util.spec_from_file_location(f"user_plugin_{abs(hash(str(p.resolve())))}", p)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise error(f"{what} {ref}: failed to import ({type(e).__name__}: {e})") from e
        return module
    try:
        return importlib.import_module(head)
    except Exception as e:
        raise error(f"{what} {ref}: module '{head}' failed to import ({type(e).__name__}: {e})") from e


def load_callable(ref: str, default_attr: str, what: str, signature: str, error: type[Exception] = PluginError) -> Callable[..., Any]:
    """The callable ``ref`` names; ``error`` (naming ``what`` and ``ref``) when it is missing, fails to import
    or is not callable."""
    _, attr, _ = split_ref(ref, default_attr)
    func = getattr(load_module(ref, what, error), attr, None)
    if not callable(func):
        raise error(f"{what} {ref}: defines no callable '{attr}{signature}'")
    return func
