"""Several Ray nodes on this machine, on 127.0.0.1 only: a stand-in for a cluster of several machines, to try
``cluster.address`` and to test and benchmark the stages on one (Ray's own ``ray.cluster_utils.Cluster``).

``python -m stages.common.local_cluster --nodes 2 --info FILE`` starts a head node with no CPUs (like a KubeRay
head that only schedules) and ``--nodes`` worker nodes of ``--cpus`` CPUs each, with a custom resource
``node<i>`` of 1 each; every process listens on 127.0.0.1 (Ray's single-machine mode) and the cluster uses token
authentication with the token in ``RAY_AUTH_TOKEN`` (export it in the shell that starts this and the drivers: a
driver of this project that has it sets ``RAY_AUTH_MODE=token`` itself). ``FILE`` gets ``{"address": ..., "nodes":
[{"name", "node_id", "raylet_pid"}], "gcs_pid", "pid"}``. It runs until stopped: SIGTERM or SIGINT (Ctrl-C), or
``python -m stages.common.local_cluster stop --info FILE``; so it may run in the background (``&``). With
``--stdin``, each line read on stdin adds a node of that name (``add NAME``) and end of input shuts it down too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

EPILOG = """It runs until stopped: SIGTERM, Ctrl-C, or
  python -m stages.common.local_cluster stop --info FILE

Example (the token in the shell, for the cluster and every driver that joins it):
  export RAY_AUTH_TOKEN=$(openssl rand -hex 32)
  python -m stages.common.local_cluster --info /tmp/c.json &
  python -m stages.sft recipes/sft/tiny.yaml cluster.address=$(python -c "import json; print(json.load(open('/tmp/c.json'))['address'])")
  python -m stages.common.local_cluster stop --info /tmp/c.json
"""


def _node_info(name: str, node) -> dict:
    return {"name": name, "node_id": node.node_id, "raylet_pid": node.all_processes["raylet"][0].process.pid}


def stop(info: str, timeout_s: float = 120.0) -> None:
    """End the cluster whose info file is ``info`` (SIGTERM to its process) and wait until it has shut down."""
    import time

    path = Path(info)
    if not path.is_file():
        sys.exit(f"local_cluster stop: {path}: no such info file (the --info of a running local cluster)")
    pid = json.loads(path.read_text())["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        sys.exit(f"local_cluster stop: process {pid} of {path} is not running")
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped by its parent
                raise psutil.NoSuchProcess(pid)
        except psutil.NoSuchProcess:
            print(f"local_cluster: stopped (pid {pid})")
            return
        time.sleep(0.2)
    sys.exit(f"local_cluster stop: process {pid} still running after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stop"]:
        sp = argparse.ArgumentParser(prog="python -m stages.common.local_cluster stop", description="stop a running local cluster")
        sp.add_argument("--info", required=True)
        return stop(sp.parse_args(argv[1:]).info)
    ap = argparse.ArgumentParser(prog="python -m stages.common.local_cluster", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--info", required=True, help="where the cluster's address, nodes and pid are written (JSON)")
    ap.add_argument("--stdin", action="store_true", help="read 'add NAME' lines on stdin (a node each); end of input stops the cluster")
    ap.add_argument("--temp-dir", default=None, help="Ray's folder (default: a new one under /tmp)")
    ap.add_argument("--node-env", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="an environment variable for one worker node's processes (repeatable)")
    args = ap.parse_args(argv)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node at 127.0.0.1, every server bound there
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
        sys.exit("local_cluster: set RAY_AUTH_TOKEN (the cluster's token; drivers joining it need the same)")
    import ray._private.utils
    from ray.cluster_utils import Cluster

    # Cluster() records its address in /tmp/ray/ray_current_cluster, where any ray.init() on this machine would
    # find it: this cluster is joined by its address only
    ray._private.utils.write_ray_address = lambda *a, **k: None

    temp = args.temp_dir or tempfile.mkdtemp(prefix="rlclu-", dir="/tmp")
    node_env: dict[str, dict[str, str]] = {}
    for item in args.node_env:
        name, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        node_env.setdefault(name, {})[key] = value
    # node loss is noticed in ~3 s instead of Ray's default ~15-30 s
    system = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3, "health_check_timeout_ms": 1000}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp, "include_dashboard": False,
                                                            "_system_config": system})
    info = {"address": cluster.address, "temp_dir": temp, "nodes": [], "pid": os.getpid(),
            "gcs_pid": cluster.head_node.all_processes["gcs_server"][0].process.pid}

    def add(name: str) -> None:
        node = cluster.add_node(num_cpus=args.cpus, resources={name: 1}, temp_dir=temp, env_vars=node_env.get(name))
        info["nodes"].append(_node_info(name, node))
        # Ray's node installs a SIGTERM handler of its own (drain, then exit 1): ours shuts the whole cluster down
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        tmp = Path(args.info).with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(args.info)

    try:
        for i in range(args.nodes):
            add(f"node{i}")
        print(f"local_cluster: {cluster.address} ({args.nodes} worker nodes); stop: python -m stages.common.local_cluster "
              f"stop --info {args.info}", flush=True)
        if args.stdin:
            for line in sys.stdin:
                if line.startswith("add "):
                    add(line.split()[1])
        else:
            signal.pause()  # until SIGTERM (or SIGINT: KeyboardInterrupt)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.shutdown()
        if args.temp_dir is None:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
