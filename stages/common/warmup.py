"""Build DeepSpeed's JIT ops (the CPU shared-memory collective) once, into the project cache.

``make setup`` runs it so that the first training stage does not spend ~40 s compiling.
"""

from __future__ import annotations

import tempfile

from stages.common.launcher import launch


def init_rank(job: dict, rank: int, world_size: int) -> dict:
    from stages.common.trainer import init_distributed

    init_distributed()
    return {"ok": True}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        launch("stages.common.warmup:init_rank", {}, 1, d, timeout_s=1800)  # a compile that hangs must not hang setup
    print("DeepSpeed ops ready")
