"""The stages a pipeline can run, by name: each entry names the ``SPEC`` its module declares.

Adding a stage is its module (a config, ``run_<stage>``, a ``main()`` and ``SPEC``) plus one line here.
Modules are imported when first asked for (:func:`spec`).
"""

from __future__ import annotations

import functools
import pkgutil

from stages.common.stage import StageSpec

STAGES: dict[str, str] = {
    "tiny_model": "stages.tiny_model:SPEC",
    "sft": "stages.sft:SPEC",
    "reward_model": "stages.reward_model:SPEC",
    "dpo": "stages.dpo:SPEC",
    "rl": "stages.rl.driver:SPEC",
    "lora_merge": "stages.lora_merge:SPEC",
    "eval": "stages.eval:SPEC",
}


@functools.cache
def spec(name: str) -> StageSpec:
    if name not in STAGES:
        raise KeyError(f"unknown stage {name!r}; expected one of {sorted(STAGES)}")
    found = pkgutil.resolve_name(STAGES[name])
    if not isinstance(found, StageSpec) or found.name != name:
        raise TypeError(f"{STAGES[name]}: expected the StageSpec of stage {name!r}, got {found!r}")
    return found
