"""Several Ray nodes on this machine, on 127.0.0.1 only: a stand-in for a cluster of several machines, to try
``cluster.address`` and to test and benchmark the stages on one (Ray's own ``ray.cluster_utils.Cluster``).

``python -m stages.common.local_cluster --nodes 2 --info FILE`` starts a head node with no CPUs (like a KubeRay
head that only schedules) and ``--nodes`` worker nodes of ``--cpus`` CPUs each, with a custom resource
``node<i>`` of 1 each; every process listens on 127.0.0.1 (Ray's single-machine mode) and the cluster uses token
authentication with the token in ``RAY_AUTH_TOKEN`` (set it in this command's environment and in the drivers').
``FILE`` gets ``{"address": ..., "nodes": [{"name", "node_id", "raylet_pid"}], "gcs_pid"}``. Each line read on
stdin adds a node of that name (``add NAME``); end of input (or SIGTERM) shuts the cluster down.
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


def _node_info(name: str, node) -> dict:
    return {"name": name, "node_id": node.node_id, "raylet_pid": node.all_processes["raylet"][0].process.pid}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--info", required=True)
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
    info = {"address": cluster.address, "temp_dir": temp, "nodes": [],
            "gcs_pid": cluster.head_node.all_processes["gcs_server"][0].process.pid}

    def add(name: str) -> None:
        node = cluster.add_node(num_cpus=args.cpus, resources={name: 1}, temp_dir=temp, env_vars=node_env.get(name))
        info["nodes"].append(_node_info(name, node))
        tmp = Path(args.info).with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(args.info)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for i in range(args.nodes):
            add(f"node{i}")
        for line in sys.stdin:
            if line.startswith("add "):
                add(line.split()[1])
    finally:
        cluster.shutdown()
        if args.temp_dir is None:
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
