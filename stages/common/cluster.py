"""Where a stage's Ray actors run: the cluster (a private loopback one, or the user's), deadlines, placement,
and starting a group of DeepSpeed ranks as actors.

- :func:`ray_cluster`: a private local Ray cluster for one stage run (token authentication, every server on
  127.0.0.1, a reaper for a SIGKILLed driver, stale folders removed), or the cluster at an address; always
  shut down, and the token goes with it.
- :class:`Deadlines` / :func:`ray_get`: every wait on an actor has a deadline, and the error names the role,
  the method, the ranks still pending and the setting that bounds it.
- :class:`Placement`: one placement group for a stage's actors and the options that put each in its bundle.
- :func:`start_group`: ``n`` ranks of a class as Ray actors forming one torch.distributed group.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.common.identity import PROJECT_ROOT
from stages.common.reaper import start as start_reaper


class CallTimeout(RuntimeError):
    """An actor gave no answer within ``ray.call_timeout_s`` (``ray.startup_timeout_s`` while starting); the
    message names it and the deadline's setting."""


def ray_get(refs, what: str, timeout_s: float, setting: str = "ray.call_timeout_s"):
    """``ray.get`` with a deadline (the config field ``setting``): ``what`` (``role.method``) and the rank of
    every call still pending are named in the error (the actors of a list are in rank order)."""
    import ray

    many = isinstance(refs, list)
    refs_list = refs if many else [refs]
    _, pending = ray.wait(refs_list, num_returns=len(refs_list), timeout=timeout_s)
    if pending:
        ranks = [i for i, r in enumerate(refs_list) if r in pending]
        role, _, method = what.partition(".")
        raise CallTimeout(f"RL stage: {role} rank(s) {ranks} of {len(refs_list)} gave no answer to {method or what} within "
                          f"{timeout_s:g} s ({setting}); stopping the stage and its Ray cluster")
    out = ray.get(refs_list)
    return out if many else out[0]


@dataclass(frozen=True)
class Deadlines:
    """The two deadlines of a stage's waits on its actors: starting up (model loads, engine start) and each call."""

    call_s: float
    startup_s: float

    def call(self, refs, what: str):
        return ray_get(refs, what, self.call_s, "ray.call_timeout_s")

    def startup(self, refs, what: str):
        return ray_get(refs, what, self.startup_s, "ray.startup_timeout_s") if refs else []


ACTOR_ENV = ("TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_CPU_KVCACHE_SPACE",
             "RLHF_FAULT_STEP", "RLHF_FAULT_RANK", "RLHF_FAULT_MODE", "RLHF_FAULT_HANG")


def actor_env(threads: int | None = None) -> dict[str, str]:
    """The environment every actor gets: this project on ``PYTHONPATH``, the caches and test hooks set here,
    vLLM in-process; ``threads``: its OpenMP threads (Ray pins them to an actor's CPU count, 1 for num_cpus=0)."""
    env = {k: os.environ[k] for k in ACTOR_ENV if k in os.environ}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(max(1, threads))
    return env


_PRIVATE_CLUSTER_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def private_cluster_env() -> None:
    """Settings of a private cluster, before Ray starts: token authentication with a fresh token (in this
    process's environment only, inherited by Ray's processes and never written or logged), and every
    Ray server bound to 127.0.0.1 (Ray's single-machine mode: the node address is loopback, so the GCS,
    raylet, object manager, agents and workers listen there and nowhere else)."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    if "ray" in sys.modules:  # imported earlier in this process: Ray caches both settings at import
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config

        ray_constants.ENABLE_RAY_CLUSTER = False
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


RAY_TMP_PREFIX = "rlray-"


def remove_stale_cluster_folders() -> None:
    """Private clusters' temp folders (``/tmp/rlray-<pid>-*``) whose process is gone and whose reaper did not
    run (both killed at once, a reboot): removed at the next start."""
    import psutil

    for folder in Path("/tmp").glob(f"{RAY_TMP_PREFIX}*-*"):
        try:
            owner = int(folder.name[len(RAY_TMP_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not psutil.pid_exists(owner):
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _unwind_on_sigterm() -> Iterator[None]:
    """SIGTERM (a killed task, a stopped worker) unwinds through the block's cleanup like Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _terminate(signum, frame):
        raise SystemExit(f"stage stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _restored_env(keys: tuple[str, ...]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _end_local_cluster(before: set[int], tmp: str, reaper) -> None:
    """Shut Ray down and wait for the local cluster's processes (its raylet, GCS, agents and workers descend from
    this process and exit a moment after shutdown; any that linger are killed), then remove its folder."""
    import psutil
    import ray

    skip = before | {reaper.pid}  # the reaper leaves once the folder is gone
    ours = []  # Ray's own: the processes it started here name the cluster's folder (other children, e.g. W&B's, are not)
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if p.pid not in skip and tmp in " ".join(p.cmdline()):
                ours += [p, *p.children(recursive=True)]
    ray.shutdown()
    _, alive = psutil.wait_procs(ours, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(subprocess.TimeoutExpired):  # it sees the folder gone and exits
        reaper.wait(timeout=5)


@contextmanager
def ray_cluster(address: str | None, num_cpus: int) -> Iterator[str | None]:
    """A private local Ray cluster of ``num_cpus`` CPUs for this stage run, or the one at ``address``; always
    shut down. Yields the private cluster's temp folder (None at an address)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with _restored_env(_PRIVATE_CLUSTER_ENV), _unwind_on_sigterm():  # the token dies with its cluster
        if not address:
            private_cluster_env()
        import psutil  # a dependency of DeepSpeed and vLLM
        import ray

        if address:
            try:
                ray.init(address=address, runtime_env={"env_vars": actor_env()}, log_to_driver=True)
                yield None
            finally:
                ray.shutdown()
            return
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        remove_stale_cluster_folders()
        # short: Ray's socket paths are length-limited; the pid says whose it is (remove_stale_cluster_folders)
        tmp = tempfile.mkdtemp(prefix=f"{RAY_TMP_PREFIX}{os.getpid()}-", dir="/tmp")
        # if this process is SIGKILLed, the reaper ends the cluster's processes and removes its folder
        reaper = start_reaper(os.getpid(), tmp)
        try:  # ray.init included: whatever fails from here on unwinds through the shutdown
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp,
                     runtime_env={"env_vars": actor_env()}, log_to_driver=True)
            yield tmp
        finally:
            _end_local_cluster(before, tmp, reaper)


class Placement:
    """One placement group for a stage's actors and the options that put each actor in its bundle.

    CPU: one 1-CPU bundle per trainer rank; engines, critic ranks and any helper take no CPU reservation (they
    run while the trainer ranks wait). GPU: one GPU per trainer rank and per critic rank, and per engine
    ``tp`` GPUs of their own, or with ``colocate`` shares of the trainer ranks' GPUs.
    """

    def __init__(self, ranks: int, engines: int, tp: int, critics: int, colocate: bool, gpu: bool, deadlines: Deadlines):
        from ray.util.placement_group import placement_group

        self.ranks, self.engines, self.tp, self.critics, self.colocate, self.gpu = ranks, engines, tp, critics, colocate, gpu
        self.own_bundles = gpu and not colocate
        bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(ranks)]
        if self.own_bundles:
            bundles += [{"GPU": tp} for _ in range(engines)] + [{"GPU": 1} for _ in range(critics)]
        self.pg = placement_group(bundles, strategy="PACK")
        deadlines.startup(self.pg.ready(), "placement group")

    def _at(self, bundle: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)}

    def rank(self, r: int) -> dict:
        share = 0.5 if not self.critics else 0.25
        return {"num_cpus": 1, "num_gpus": (share if self.colocate else 1) if self.gpu else 0, **self._at(r)}

    def engine(self, i: int) -> dict:
        if self.own_bundles:
            return {"num_cpus": 0, "num_gpus": self.tp, **self._at(self.ranks + i)}
        return {"num_cpus": 0, "num_gpus": (0.5 / max(1, self.engines // self.ranks)) if self.gpu else 0, **self._at(i % self.ranks)}

    def critic(self, r: int) -> dict:
        if self.own_bundles:
            return {"num_cpus": 0, "num_gpus": 1, **self._at(self.ranks + self.engines + r)}
        return {"num_cpus": 0, "num_gpus": 0.25 if self.gpu else 0, **self._at(r % self.ranks)}


def start_group(cls, n: int, opts: Callable[[int], dict], env: dict[str, str], deadlines: Deadlines,
                *setup_args: Any) -> tuple[list, list]:
    """``n`` ranks of ``cls`` (``cls(rank, n)``, with ``address()`` and ``setup(*setup_args, master)``) as Ray
    actors forming one torch.distributed group: the actors, in rank order, and their pending ``setup`` calls
    (wait with :meth:`Deadlines.startup`; other actors can start meanwhile)."""
    import ray

    actors = [ray.remote(cls).options(runtime_env={"env_vars": env}, **opts(r)).remote(r, n) for r in range(n)]
    master = deadlines.startup(actors[0].address.remote(), f"{cls.__name__.lower()}.address")
    return actors, [a.setup.remote(*setup_args, master) for a in actors]
