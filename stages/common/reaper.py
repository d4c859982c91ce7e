"""A watchdog that ends what a process started when that process dies, however it dies (SIGKILL too).

``python -m stages.common.reaper PID [FOLDER]`` runs in a session of its own (so a kill of the watched
process's group does not take it along). Every half second it records the processes that have appeared
under PID since it started (by pid and start time, so a reused pid is never mistaken for one of them).
When PID is gone it ends every recorded process still alive (SIGTERM, then SIGKILL after 5 s) and removes
FOLDER; it exits without doing anything once FOLDER no longer exists (the watched code cleaned up itself).

The RL stage watches its private Ray cluster with one (Ray's GCS, raylet, agents and workers, and the
cluster's temp folder); the flow CLI watches Prefect's temporary server with one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil


def start(pid: int, folder: str | Path | None = None) -> subprocess.Popen:
    """Start a reaper for ``pid`` (and ``folder``) in its own session."""
    cmd = [sys.executable, "-m", "stages.common.reaper", str(pid), *([str(folder)] if folder else [])]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _descendants(proc: psutil.Process) -> dict[int, float]:
    try:
        return {c.pid: c.create_time() for c in proc.children(recursive=True)}
    except psutil.Error:
        return {}


def _end(recorded: dict[int, float]) -> None:
    alive = []
    for pid, created in recorded.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01:
                alive.append(p)
        except psutil.Error:
            continue
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=5)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass


def watch(pid: int, folder: Path | None) -> None:
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return
    before = set(_descendants(proc)) | {os.getpid()}
    recorded: dict[int, float] = {}
    while True:
        if folder is not None and not folder.exists():
            return  # cleaned up by the watched process itself
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            break
        recorded.update({p: t for p, t in _descendants(proc).items() if p not in before})
        time.sleep(0.5)
    _end(recorded)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
