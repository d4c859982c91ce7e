"""Start N training ranks as subprocesses of the stage, wait, and surface the first failure.

Each rank runs ``python -m stages.common.worker TARGET JOB.json`` with the usual torch.distributed
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT). Ranks run in their own process group, so on a
failure, a timeout or Ctrl-C every rank (and anything it started) is killed; a failed rank's
traceback becomes the text of the :class:`StageFailed` the stage raises. Rank 0's stdout is the
stage's (progress bar); every rank also logs to ``RUN_DIR/logs/rank{r}.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from stages.common import worker  # each rank's entry point (imported so it is in every stage's code version)
from stages.common.config import ClusterConfig
from stages.common.errors import StageFailed, StageTimeout, free_port  # noqa: F401  (the launcher's errors, as callers know them)
from stages.common.identity import PROJECT_ROOT


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(threads)),
        PYTHONPATH=os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
    )
    # DeepSpeed JIT-builds its CPU ops once; keep them in a project cache instead of ~/.cache.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching process dies, however it dies (SIGKILL,
    OOM), so no rank outlives its stage (Linux prctl PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # whatever survived SIGTERM, and any children left in the group
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _error_time(run_dir: Path, rank: int) -> float:
    err = run_dir / f"rank{rank}.error"
    return err.stat().st_mtime_ns if err.is_file() else float("inf")


def _failure_text(run_dir: Path, rank: int, code: int) -> str:
    err = run_dir / f"rank{rank}.error"
    if err.is_file():
        return f"rank {rank} failed:\n{err.read_text()}"
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    hint = " (killed: out of memory?)" if code in (-9, 137) else ""
    log = run_dir / "logs" / f"rank{rank}.log"
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.is_file() else ""
    return f"rank {rank} died with {how}{hint}; last log lines:\n{tail}"


def _wait(procs: list[subprocess.Popen], target: str, run_dir: Path, timeout_s: float | None) -> None:
    """Until every rank exits 0; a rank that fails (the first to write its traceback is the cause: the others die
    of its absence) or the deadline ends them all with a :class:`StageFailed` / :class:`StageTimeout`."""
    start = time.time()
    while True:
        codes = [p.poll() for p in procs]
        failed = sorted(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), key=lambda rc: _error_time(run_dir, rc[0]))
        if failed:
            _kill(procs)
            raise StageFailed(_failure_text(run_dir, *failed[0]))
        if all(c == 0 for c in codes):
            return
        if timeout_s is not None and time.time() - start > timeout_s:
            running = [r for r, c in enumerate(codes) if c is None]
            _kill(procs)
            raise StageTimeout(f"{target}: no result within its deadline of {timeout_s:g} s; rank(s) {running} of "
                               f"{len(procs)} still running (hung?) were ended with their process groups; logs: {run_dir / 'logs'}")
        time.sleep(0.2)


def launch(target: str, job: dict, world_size: int, run_dir: str | Path, timeout_s: float | None = None,
           env: dict[str, str] | None = None, cluster: ClusterConfig | None = None, inputs: Sequence[str] = (),
           output: Path | None = None) -> dict:
    """Run ``target`` (``module:function(job, rank, world_size) -> dict``) on ``world_size`` ranks: local processes,
    or with ``cluster.address`` Ray actors on that cluster (``inputs``: the paths every node must see).

    ``env`` adds variables to the ranks' environment; ``output``: a file for rank 0's output (stdout and stderr),
    instead of the caller's.
    Returns rank 0's result. Raises :class:`StageFailed` with the failing rank's traceback.
    """
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in [run_dir / "result.json", *run_dir.glob("rank*.error")]:
        stale.unlink(missing_ok=True)
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2))
    if cluster is not None and cluster.address:
        from stages.common.cluster_ranks import run_ranks

        run_ranks(target, job_path, run_dir, world_size, cluster, list(inputs), timeout_s, env)
    else:
        _run_local(target, job_path, world_size, run_dir, timeout_s, env, output)
    result = run_dir / "result.json"
    return json.loads(result.read_text()) if result.is_file() else {}


PORT_TAKEN = "Address already in use (while attempting to bind on address"
START_ATTEMPTS = 3


def _run_local(target: str, job_path: Path, world_size: int, run_dir: Path, timeout_s: float | None,
               env: dict[str, str] | None, output: Path | None = None) -> None:
    """The ranks as local processes. The group's rendezvous port is picked free here and bound by rank 0 a moment
    later; if another process took it meanwhile (rank 0 fails binding it, before any work), the ranks start again
    on another port, at most ``START_ATTEMPTS`` times."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_ranks(target, job_path, world_size, run_dir, timeout_s, env, output)
        except StageFailed as e:
            if PORT_TAKEN not in str(e) or "rendezvous_store" not in str(e) or attempt == START_ATTEMPTS:
                raise
            for stale in run_dir.glob("rank*.error"):
                stale.unlink(missing_ok=True)


def _start_ranks(target: str, job_path: Path, world_size: int, run_dir: Path, timeout_s: float | None,
                 env: dict[str, str] | None, output: Path | None = None) -> None:
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            log = open(output if rank == 0 and output else run_dir / "logs" / f"rank{rank}.log", "w")
            logs.append(log)
            out = None if rank == 0 and not output else log  # rank 0 prints to the caller's output, or to ``output``
            procs.append(subprocess.Popen(
                [sys.executable, "-m", worker.__name__, target, str(job_path), str(run_dir)],
                env={**rank_env(rank, world_size, port), **(env or {})}, cwd=os.getcwd(), stdout=out,
                stderr=subprocess.STDOUT if out else None, start_new_session=True, preexec_fn=_die_with_parent,
            ))
        _wait(procs, target, run_dir, timeout_s)
    except BaseException:
        _kill(procs)
        raise
    finally:
        for log in logs:
            log.close()
