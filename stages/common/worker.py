"""Entry point of one rank: ``python -m stages.common.worker module:function JOB.json RUN_DIR`` (a local rank), or
:func:`run_rank` inside a Ray actor (a rank on a cluster, ``stages.common.cluster.run_ranks``).

Calls ``function(job, rank, world_size)``; rank 0's return value goes to ``RUN_DIR/result.json``;
any exception's traceback goes to ``RUN_DIR/rank{r}.error`` for the launcher to report.
"""

from __future__ import annotations

import json
import os
import pkgutil
import sys
import traceback
from pathlib import Path


def run_rank(target: str, job_path: Path, run_dir: Path, rank: int, world_size: int) -> None:
    """One rank's work; its traceback is kept in ``RUN_DIR/rank{r}.error`` and raised again."""
    try:
        job = json.loads(job_path.read_text())
        result = pkgutil.resolve_name(target)(job, rank, world_size)
        if rank == 0:
            tmp = run_dir / "result.json.tmp"
            tmp.write_text(json.dumps(result or {}))
            tmp.replace(run_dir / "result.json")
    except BaseException:
        (run_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def main() -> None:
    target, job_path, run_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    try:
        run_rank(target, job_path, run_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    except BaseException:
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # skip atexit/destructors that can hang on a broken process group
    # Success: leave the same way. The interpreter's teardown of torch.distributed / DeepSpeed's CPU comm threads can
    # abort ("terminate called without an active exception", signal 6) on one rank while rank 0 is still finishing,
    # which would fail a stage whose work is done. Everything the rank writes is closed by now; flush and go.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
