"""``make serve``: a local Prefect server on 127.0.0.1 plus the process serving the deployments.

Starts ``prefect server start --host 127.0.0.1 --port PORT``, waits until ``/api/health`` answers,
then runs ``python -m flows.deploy`` against it. With ``PREFECT_SERVER_API_AUTH_STRING=user:password`` in the
environment the server requires HTTP basic authentication on every API call (Prefect's own setting; the health
check stays open) and the serving process authenticates with the same credentials; other clients set
``PREFECT_API_AUTH_STRING`` to them. On Ctrl-C or SIGTERM it stops the serving process
first and the server after (the other order leaves ``serve`` hanging).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flows.pipeline import PROJECT_ROOT


def wait_healthy(api_url: str, timeout_s: float = 90.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{api_url}/health did not answer within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def local_server(port: int, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """A Prefect server on 127.0.0.1:``port`` for the duration of the block; yields its API URL."""
    env = {**os.environ, **(env or {})}
    env.pop("PREFECT_API_URL", None)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    api = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(api, proc=proc)
        yield api
    finally:
        stop(proc)


AUTH = "PREFECT_SERVER_API_AUTH_STRING"  # the server's basic authentication, "user:password"
CLIENT_AUTH = "PREFECT_API_AUTH_STRING"  # what a client sends


def client_env(api: str) -> dict[str, str]:
    """The environment of a client of the server at ``api``: its URL, and (when the server was started with basic
    authentication) the same credentials unless the client has its own."""
    env = {**os.environ, "PREFECT_API_URL": api}
    if env.get(AUTH) and not env.get(CLIENT_AUTH):
        env[CLIENT_AUTH] = env[AUTH]
    return env


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops `make serve` the way Ctrl-C does


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.local_server", description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=4200)
    args = ap.parse_args(argv)
    home = Path(os.environ.get("PREFECT_HOME", PROJECT_ROOT / ".prefect"))
    with local_server(args.port, home / "server.log") as api:
        print(f"[serve] Prefect server: {api.removesuffix('/api')} (UI), log {home / 'server.log'}", flush=True)
        auth = " PREFECT_API_AUTH_STRING=<user:password>" if os.environ.get(AUTH) else ""
        print(f"[serve] then, in another shell: PREFECT_API_URL={api}{auth} .venv/bin/prefect deployment run full-rlhf/tiny",
              flush=True)
        served = subprocess.Popen([sys.executable, "-m", "flows.deploy"], env=client_env(api), cwd=PROJECT_ROOT,
                                  start_new_session=True)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            served.wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop(served)


if __name__ == "__main__":
    main()
