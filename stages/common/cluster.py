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


def ray_get(refs, what: str, timeout_s: float, setting: str = "ray.call_timeout_s", stage: str = "RL stage"):
    """``ray.get`` with a deadline (the config field ``setting``): ``what`` (``role.method``) and the rank of
    every call still pending are named in the error (the actors of a list are in rank order)."""
    import ray

    many = isinstance(refs, list)
    refs_list = refs if many else [refs]
    _, pending = ray.wait(refs_list, num_returns=len(refs_list), timeout=timeout_s)
    if pending:
        ranks = [i for i, r in enumerate(refs_list) if r in pending]
        role, _, method = what.partition(".")
        raise CallTimeout(f"{stage}: {role} rank(s) {ranks} of {len(refs_list)} gave no answer to {method or what} within "
                          f"{timeout_s:g} s ({setting}); stopping the stage and its Ray cluster")
    out = ray.get(refs_list)
    return out if many else out[0]


class ActorFailed(RuntimeError):
    """An actor's call failed (or the actor died) while others of the same exchange were still waiting on it."""


def ray_get_together(groups: list[tuple[str, list]], timeout_s: float, setting: str = "ray.call_timeout_s",
                     stage: str = "RL stage") -> list[list]:
    """Wait for the calls of several groups that wait on each other (a broadcast's sender and receivers): the first
    call to fail ends the wait at once, naming its role and rank, instead of leaving the driver on the calls blocked
    by it; past ``timeout_s`` the calls still pending are named. ``groups``: ``(role.method, refs in rank order)``."""
    import time

    import ray

    where = {ref: (what, i, len(refs)) for what, refs in groups for i, ref in enumerate(refs)}
    pending, deadline = list(where), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise CallTimeout(f"{stage}: no answer within {timeout_s:g} s ({setting}) from {_late(where, pending)}; stopping "
                              "the stage and its Ray cluster")
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001  (the actor's error or death, named)
                what, i, n = where[ref]
                role, _, method = what.partition(".")
                first = (str(e).strip().splitlines() or [""])[0]
                raise ActorFailed(f"{stage}: {role} rank {i} of {n} failed during {method}: {type(e).__name__}: {first}") from e
    return [ray.get(refs) for _, refs in groups]


def _late(where: dict, pending: list) -> str:
    """The calls still pending, by role: ``learner rank(s) [1] of 2 to train; ...``."""
    still = set(pending)
    groups = {w: n for w, _, n in where.values()}
    return "; ".join(f"{what.partition('.')[0]} rank(s) {[i for r, (w, i, _) in where.items() if w == what and r in still]} "
                     f"of {n} to {what.partition('.')[2]}" for what, n in groups.items() if any(where[r][0] == what for r in still))


@dataclass(frozen=True)
class Deadlines:
    """The two deadlines of a stage's waits on its actors: starting up (model loads, engine start) and each call."""

    call_s: float
    startup_s: float

    def call(self, refs, what: str):
        return ray_get(refs, what, self.call_s, "ray.call_timeout_s")

    def startup(self, refs, what: str):
        return ray_get(refs, what, self.startup_s, "ray.startup_timeout_s") if refs else []

    def together(self, groups: list[tuple[str, list]], starting: bool = False) -> list[list]:
        """:func:`ray_get_together` under the call deadline (``starting``: the startup one)."""
        if starting:
            return ray_get_together(groups, self.startup_s, "ray.startup_timeout_s")
        return ray_get_together(groups, self.call_s, "ray.call_timeout_s")


ACTOR_ENV = ("TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_CPU_KVCACHE_SPACE",
             "RLHF_FAULT_STEP", "RLHF_FAULT_RANK", "RLHF_FAULT_MODE", "RLHF_FAULT_HANG",
             "RLHF_FAULT_ENGINE_DIES")


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
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _ray_settings(single_machine=True)


def driver_auth(environ) -> None:
    """A driver given the cluster's token (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``) sends it: Ray does only
    with ``RAY_AUTH_MODE=token``, which is set here unless the user set the mode."""
    if environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH"):
        environ.setdefault("RAY_AUTH_MODE", "token")


def _ray_settings(single_machine: bool) -> None:
    """Ray's node-address mode (single machine: loopback) and its authentication as the environment says now; Ray
    caches both at import, so a process that imported it earlier re-reads them."""
    if single_machine:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if "ray" in sys.modules:
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config

        ray_constants.ENABLE_RAY_CLUSTER = not single_machine
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
def restored_env(keys: tuple[str, ...]) -> Iterator[None]:
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
def ray_cluster(address: str | None, num_cpus: int, ship_code: bool = True, connect_timeout_s: float = 60.0) -> Iterator[str | None]:
    """A private local Ray cluster of ``num_cpus`` CPUs for this stage run, or the user's at ``address`` (joined
    with :func:`join`, left as it was); the private one is always shut down. Yields its temp folder (None at an
    address)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with restored_env(_PRIVATE_CLUSTER_ENV), _unwind_on_sigterm():  # the token dies with its cluster
        if not address:
            private_cluster_env()
        import psutil  # a dependency of DeepSpeed and vLLM
        import ray

        if address:
            try:
                join(address, ship_code, connect_timeout_s)
                yield None
            finally:
                ray.shutdown()  # the driver leaves; the user's cluster keeps running
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
    run while the trainer ranks wait). GPU: one GPU per trainer rank, per critic rank and for the reward-model
    scorer, and per engine ``tp`` GPUs of their own; or with ``colocate`` shares of the trainer ranks' GPUs (each
    GPU: its learner 1/4, its engines 1/2, its critic rank 1/8, the scorer 1/8 of rank 0's). On a user's cluster
    (``remote``) the engines have bundles of their own on CPU too (a CPU each), so that they may be placed on other
    nodes than the learners (``strategy``: Ray's placement strategy).
    """

    def __init__(self, ranks: int, engines: int, tp: int, critics: int, colocate: bool, gpu: bool, deadlines: Deadlines,
                 strategy: str = "PACK", remote: bool = False, scorer: bool = False):
        from ray.util.placement_group import placement_group

        self.ranks, self.engines, self.tp, self.critics, self.colocate, self.gpu = ranks, engines, tp, critics, colocate, gpu
        self.own_engines = not colocate and (gpu or remote)
        self.own_critics = gpu and not colocate
        self.own_scorer = gpu and not colocate and scorer
        bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(ranks)]
        if self.own_engines:
            bundles += [{"GPU": tp} if gpu else {"CPU": 1} for _ in range(engines)]
        if self.own_critics:
            bundles += [{"GPU": 1} for _ in range(critics)]
        if self.own_scorer:
            bundles.append({"GPU": 1})
        self.bundles = len(bundles)
        self.pg = placement_group(bundles, strategy=strategy)
        deadlines.startup(self.pg.ready(), "placement group")

    def _at(self, bundle: int) -> dict:
        return bundle_at(self.pg, bundle)

    def rank(self, r: int) -> dict:
        return {"num_cpus": 1, "num_gpus": (0.25 if self.colocate else 1) if self.gpu else 0, **self._at(r)}

    def engine(self, i: int) -> dict:
        if self.own_engines:
            return {"num_cpus": 0 if self.gpu else 1, "num_gpus": self.tp if self.gpu else 0, **self._at(self.ranks + i)}
        return {"num_cpus": 0, "num_gpus": (0.5 / max(1, self.engines // self.ranks)) if self.gpu else 0, **self._at(i % self.ranks)}

    def critic(self, r: int) -> dict:
        if self.own_critics:
            return {"num_cpus": 0, "num_gpus": 1, **self._at(self.ranks + self.engines + r)}
        return {"num_cpus": 0, "num_gpus": 0.125 if self.gpu else 0, **self._at(r % self.ranks)}

    def scorer(self) -> dict:
        """The reward-model scorer: a GPU of its own, a share of rank 0's, or (CPU) no reservation beside rank 0."""
        if self.own_scorer:
            return {"num_cpus": 0, "num_gpus": 1, **self._at(self.bundles - 1)}
        return {"num_cpus": 0, "num_gpus": 0.125 if self.gpu else 0, **self._at(0)}


def start_group(cls, n: int, opts: Callable[[int], dict], env: dict[str, str], deadlines: Deadlines,
                *setup_args: Any, method: str = "setup") -> tuple[list, list, list[tuple[str, str]]]:
    """``n`` ranks of ``cls`` (``cls(rank, n)``, with ``address()``, ``node()`` and ``setup(*setup_args, master)``)
    as Ray actors forming one torch.distributed group: the actors, in rank order, their pending ``setup`` calls
    (``method``: another method of that signature; wait with :meth:`Deadlines.startup`; other actors can start
    meanwhile) and the node (id, address) each runs on. The group meets at rank 0's node address
    (:func:`rank_address`)."""
    import ray

    name = cls.__name__.lower()
    actors = [ray.remote(cls).options(runtime_env={"env_vars": env}, **opts(r)).remote(r, n) for r in range(n)]
    nodes = deadlines.startup([a.node.remote() for a in actors], f"{name}.node")
    master = deadlines.startup(actors[0].address.remote(), f"{name}.address")
    return actors, [getattr(a, method).remote(*setup_args, master) for a in actors], nodes


class GroupRank:
    """A rank of a torch.distributed group of Ray actors (:func:`start_group`): where the group meets (rank 0's
    node address), the node it runs on, and the group's environment for ``trainer.init_distributed``."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        return rank_address()

    def node(self) -> tuple[str, str]:
        return node_of_actor()

    def group_env(self, master: tuple[str, int]) -> None:
        # under Ray an actor sees only the GPU(s) it was given (CUDA_VISIBLE_DEVICES), as device 0 upward: its local
        # device is 0 whatever its rank (set_device(rank) would name a device it cannot see)
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))


def node_of_actor() -> tuple[str, str]:
    """Inside an actor: its node's id and address (what ``placement.json`` records)."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def write_placement(path: Path, roles: dict[str, list[tuple[str, str]]]) -> None:
    """``path`` (``RUN_DIR/placement.json``): for each role, the node id and address of each of its actors, in order."""
    import json

    path.write_text(json.dumps({role: [{"node_id": n, "address": ip} for n, ip in nodes] for role, nodes in roles.items()}, indent=2))


def rank_address() -> tuple[str, int]:
    """Inside an actor: its node's address and a free port there (where a group's rank 0 is met)."""
    import ray

    from stages.common.errors import free_port

    host = ray.util.get_node_ip_address()
    return host, free_port(host)


class ClusterError(RuntimeError):
    """The cluster at ``cluster.address`` can't run the stage: unreachable, no room for its ranks, or a node that
    does not see the stage's files."""


# the project's packages a rank imports: shipped with the job (runtime_env py_modules) unless cluster.ship_code=false
SHIPPED_PACKAGES = ("stages", "checkpoints", "datasets_prep")


def _check_reachable(address: str, timeout_s: float) -> str | None:
    """The host of ``host:port`` / ``ray://host:port`` once something accepts a connection there (``ray.init`` to an
    unreachable address retries without end); None for ``auto``."""
    import socket

    if address == "auto":
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 10.0)).close()
    except (OSError, ValueError) as e:
        raise ClusterError(f"cluster.address: {address!r}: nothing accepts a connection there ({e}); expected the address "
                           "of a running Ray cluster's head: auto, host:port (its GCS port, 6379 by default) or "
                           "ray://host:port (Ray Client, 10001)") from None
    return host.strip("[]")


def join(address: str, ship_code: bool = True, connect_timeout_s: float = 60.0) -> None:
    """Join the user's Ray cluster at ``address`` as a driver: with its own authentication (``RAY_AUTH_TOKEN`` or
    ``RAY_AUTH_TOKEN_PATH`` from the environment; never logged), the project's sources shipped with the job unless
    ``ship_code`` is false (then the nodes run the same image), and, for a cluster on 127.0.0.1 (several Ray nodes
    on one machine), in Ray's single-machine mode so that this driver's address is loopback too."""
    import ray

    host = _check_reachable(address, connect_timeout_s)
    driver_auth(os.environ)
    _ray_settings(single_machine=host in ("127.0.0.1", "localhost", "::1"))
    runtime_env: dict[str, Any] = {"env_vars": actor_env()}
    if ship_code:
        runtime_env.update(py_modules=[str(PROJECT_ROOT / m) for m in SHIPPED_PACKAGES], excludes=["__pycache__", "*.pyc"])
    ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)


def uses_gpu(requested: bool | None) -> bool:
    """GPU ranks or CPU ranks, as the cluster's resources say (a driver on a CPU head places GPU ranks on GPU
    workers); ``requested`` (``cluster.gpu``) overrides, and asking for GPUs on a cluster without any is an error."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if requested and not gpus:
        raise ClusterError("cluster.gpu: true, but the cluster has no GPU resources (ray.cluster_resources())")
    return bool(gpus) if requested is None else requested


def bundle_at(pg, bundle: int) -> dict:
    """The options that put a task or an actor into bundle ``bundle`` of placement group ``pg``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)}


def _sees(marker: str, token: str, paths: list[str]) -> tuple[str, str, list[str]]:
    """On a node: its id, its address, and which of the marker (with ``token`` inside) and ``paths`` it can't read.
    Test hook: RLHF_FAULT_HIDE_PATHS (``os.pathsep``-separated prefixes) makes this node miss those paths."""
    import ray

    hidden = [h for h in os.environ.get("RLHF_FAULT_HIDE_PATHS", "").split(os.pathsep) if h]

    def seen(path: str) -> bool:
        return not any(path.startswith(h) for h in hidden) and os.path.exists(path)

    missing = [] if seen(marker) and Path(marker).read_text() == token else [str(Path(marker).parent)]
    missing += [p for p in paths if not seen(p)]
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), missing


def check_storage(pg, bundles: int, folder: Path, paths: list[str], timeout_s: float) -> None:
    """Every node of the placement group sees ``folder`` (where the stage writes: a marker written here is read
    there) and ``paths`` (its inputs) at the same paths; else a :class:`ClusterError` names the node and the path."""
    import ray

    token = secrets.token_hex(16)
    marker = folder / f".cluster-check-{token[:8]}"
    marker.write_text(token)
    try:
        refs = [ray.remote(_sees).options(num_cpus=0, **bundle_at(pg, b)).remote(str(marker), token, paths) for b in range(bundles)]
        answers = ray_get(refs, "storage check", timeout_s, "cluster.connect_timeout_s", stage="cluster")
    finally:
        marker.unlink(missing_ok=True)
    for node, ip, missing in answers:
        if missing:
            raise ClusterError(f"cluster: node {node} ({ip}) can't see {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                               + ", which this stage writes or reads on every node it runs on: running on a cluster needs a "
                               "filesystem every node sees at the same path (a shared volume), for the output root and the inputs")


def cluster_placement(bundles: list[dict], strategy: str, timeout_s: float):
    """One placement group of ``bundles``, ready within ``timeout_s`` (``cluster.connect_timeout_s``) or a
    :class:`ClusterError` that says what did not fit."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(f"cluster: no room for {len(bundles)} bundles {bundles} placed {strategy} within {timeout_s:g} s "
                           f"(cluster.connect_timeout_s); the cluster has {ray.available_resources()} available "
                           "(STRICT_SPREAD needs a node per bundle)")
    return pg
