"""The local ranks' rendezvous port: picked free by the launcher, bound by rank 0 a moment later. Another process
taking it in between must not fail a stage: one rank binds a port of the kernel's choosing, a group starts again
on another port."""

from __future__ import annotations

import socket

import pytest

from stages.common import launcher

pytestmark = pytest.mark.integration


def meet_rank(job: dict, rank: int, world_size: int) -> dict:
    """Launcher target: join the group at the rendezvous and all-reduce each rank's number + 1."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from stages.common.trainer import rendezvous_store

    store = rendezvous_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"sum": t.item()}


def test_a_rendezvous_port_taken_before_rank_0_binds_it_does_not_fail_the_ranks(tmp_path, monkeypatch):
    taken = socket.create_server(("127.0.0.1", 0))  # another process's listener, on the port the launcher picks
    port = taken.getsockname()[1]
    real, picks = launcher.free_port, iter([port, port])
    monkeypatch.setattr(launcher, "free_port", lambda: next(picks, None) or real())
    try:
        assert launcher.launch("tests.integration.test_launcher_ports:meet_rank", {}, 1, tmp_path / "one") == {"sum": 1.0}
        # two ranks: the first start fails binding the taken port, the second meets on a free one
        assert launcher.launch("tests.integration.test_launcher_ports:meet_rank", {}, 2, tmp_path / "two") == {"sum": 3.0}
        assert next(picks, "used") == "used"  # both taken picks were handed out
    finally:
        taken.close()
