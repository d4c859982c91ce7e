"""The reaper ends what a SIGKILLed process started and removes its folder."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def _parent(tmp_path: Path, with_folder: bool) -> tuple[subprocess.Popen, int]:
    folder = tmp_path / "cluster"
    folder.mkdir()
    script = (
        f"import subprocess, sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
        "from stages.common.reaper import start\n"
        f"start(__import__('os').getpid(), {str(folder) if with_folder else None!r})\n"
        "time.sleep(1)\n"  # the reaper has looked at the process tree once before the child appears
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def test_a_sigkilled_process_leaves_no_child_and_no_folder(tmp_path):
    proc, child = _parent(tmp_path, with_folder=True)
    time.sleep(1.5)  # the reaper records the child (it polls every 0.5 s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _gone(child), "the child outlived its SIGKILLed parent"
    deadline = time.time() + 10
    while time.time() < deadline and (tmp_path / "cluster").exists():
        time.sleep(0.2)
    assert not (tmp_path / "cluster").exists()


def test_the_reaper_leaves_when_its_folder_is_cleaned_up(tmp_path):
    proc, child = _parent(tmp_path, with_folder=True)
    reapers = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[1:3] == ["-m", "stages.common.reaper"]
               and str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert len(reapers) == 1
    import shutil

    shutil.rmtree(tmp_path / "cluster")  # what the watched code does when it shuts down normally
    assert _gone(reapers[0].pid, timeout=10)  # exited (a zombie until its parent, the watched process, reaps it)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    os.kill(child, signal.SIGKILL)  # nobody reaps it now: the reaper had left
