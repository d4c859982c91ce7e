"""A training stage's ranks (SFT, RM, DPO) as Ray actors on the user's cluster (``cluster.address``).

The same rank function and the same job file as the local launcher's ranks: one placement group of one bundle per
rank (``cluster.strategy``; a GPU each where the cluster has GPUs), every node it spans checked to see the run
folder and the inputs, the ranks started as one torch.distributed group meeting at rank 0's node address (gloo on
CPU, NCCL on GPU), and waited on with the stage's deadline. ``RUN_DIR/placement.json`` says which node each rank
ran on. A rank that fails or a node that leaves ends the others and the error names the rank and its node; the
placement group is removed and the cluster is left running.
"""

from __future__ import annotations

import time
from pathlib import Path

from stages.common.cluster import (
    Deadlines,
    GroupRank,
    actor_env,
    bundle_at,
    check_storage,
    cluster_placement,
    ray_cluster,
    start_group,
    uses_gpu,
    write_placement,
)
from stages.common.config import ClusterConfig
from stages.common.errors import StageFailed, StageTimeout

# after a rank fails with a lost connection, how long to wait for the cluster to tell whether a node left
NODE_LOSS_GRACE_S = 60.0


class RankActor(GroupRank):
    """One rank of a stage on a cluster node (``stages.common.worker.run_rank`` with the group's environment)."""

    def run(self, target: str, job_path: str, run_dir: str, master: tuple[str, int]) -> bool:
        from stages.common.worker import run_rank

        self.group_env(master)
        run_rank(target, Path(job_path), Path(run_dir), self.rank, self.world_size)
        return True


def run_ranks(target: str, job_path: Path, run_dir: Path, world_size: int, cluster: ClusterConfig, inputs: list[str],
              timeout_s: float | None, env: dict[str, str] | None = None) -> None:
    """Run ``target`` on ``world_size`` ranks placed on the cluster at ``cluster.address``; raises
    :class:`StageFailed` (a rank failed or its node left) or :class:`StageTimeout` naming ranks and nodes."""
    import ray
    from ray.util.placement_group import remove_placement_group

    with ray_cluster(cluster.address, 0, cluster.ship_code, cluster.connect_timeout_s):
        gpu = uses_gpu(cluster.gpu)
        pg = cluster_placement([{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(world_size)], cluster.strategy,
                               cluster.connect_timeout_s)
        actors: list = []
        try:
            check_storage(pg, world_size, run_dir, inputs, cluster.connect_timeout_s)
            deadlines = Deadlines(timeout_s or 24 * 3600.0, cluster.connect_timeout_s)
            env = {**actor_env(threads=1), **(env or {})}
            actors, runs, nodes = start_group(RankActor, world_size, lambda r: {"num_cpus": 1, "num_gpus": int(gpu), **bundle_at(pg, r)},
                                              env, deadlines, target, str(job_path), str(run_dir), method="run")
            write_placement(run_dir / "placement.json", {"ranks": nodes})
            _wait(runs, nodes, target, run_dir, timeout_s)
        finally:
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)


def _wait(runs: list, nodes: list[tuple[str, str]], target: str, run_dir: Path, timeout_s: float | None) -> None:
    import ray

    start, pending = time.time(), list(runs)
    while pending:
        if timeout_s is not None and time.time() - start > timeout_s:
            running = [f"rank {r} on node {nodes[r][0]} ({nodes[r][1]})" for r, ref in enumerate(runs) if ref in pending]
            raise StageTimeout(f"{target}: no result within its deadline of {timeout_s:g} s (train.timeout_s); still running: "
                               f"{', '.join(running)}; their actors were ended; logs: Ray's worker logs on those nodes")
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a rank's failure, whatever it is, ends the stage
                raise StageFailed(_failure(runs, nodes, runs.index(ref), e, run_dir)) from None


def _failure(runs: list, nodes: list[tuple[str, str]], rank: int, error: Exception, run_dir: Path) -> str:
    """What ended the group: a node that left (the ranks elsewhere then fail of their peer's absence), else the
    earliest rank traceback that is not a lost connection, else the first failure. After a lost connection the
    cluster gets up to NODE_LOSS_GRACE_S to tell whether a node left (its health checks take some seconds)."""
    import ray

    ours = {n for n, _ in nodes}
    deadline = time.time() + NODE_LOSS_GRACE_S
    while True:
        gone = {n["NodeID"] for n in ray.nodes() if not n["Alive"]} & ours
        if gone:
            lost = [r for r, (n, _) in enumerate(nodes) if n in gone]
            node, ip = nodes[lost[0]]
            return (f"rank(s) {lost} lost: node {node} ({ip}) left the cluster during the stage (its raylet is gone); "
                    f"the other ranks were ended. Rerun the stage with train.resume=true to continue from its last "
                    f"committed state (train.save_steps)")
        causes = sorted((f.stat().st_mtime_ns, int(f.stem[4:]), f.read_text()) for f in run_dir.glob("rank*.error"))
        causes = [(r, text) for _, r, text in causes if not _lost_connection(text)]
        if causes:
            r, text = causes[0]
            return f"rank {r} on node {nodes[r][0]} ({nodes[r][1]}) failed:\n{text}"
        if not (_lost_connection(str(error)) or isinstance(error, ray.exceptions.RayActorError)) or time.time() > deadline:
            return f"rank {rank} on node {nodes[rank][0]} ({nodes[rank][1]}) failed:\n{error}"
        time.sleep(1.0)


def _lost_connection(text: str) -> bool:
    """Whether a rank's error reads as a peer (or its own node) gone rather than a failure of its own."""
    text = text.lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "connection refused",
                                   "actor died", "node has died", "unexpectedly"))
