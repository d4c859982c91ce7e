"""The one cluster setting: where it comes from (stage recipe, pipeline, CLI), what it is refused with, and that it
is not part of a run's identity."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import yaml

from flows.pipeline import plan
from stages.common.cluster import ClusterError, join
from stages.common.identity import canonical_config
from stages.common.recipe import load_config
from stages.rl.config import RLConfig
from stages.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]


def test_every_training_stage_has_the_setting_and_it_is_not_in_the_identity():
    local = load_config(SFTConfig, [str(ROOT / "recipes/sft/tiny.yaml")])
    remote = load_config(SFTConfig, [str(ROOT / "recipes/sft/tiny.yaml"), "cluster.address=10.0.0.1:6379",
                                     "cluster.strategy=STRICT_SPREAD", "cluster.ship_code=false"])
    assert remote.cluster.address == "10.0.0.1:6379" and local.cluster.address is None
    assert canonical_config(local) == canonical_config(remote)
    rl = load_config(RLConfig, [str(ROOT / "recipes/rl/tiny.yaml"), "cluster.address=auto"])
    assert rl.cluster.address == "auto" and "cluster" not in canonical_config(rl)


def test_rl_ray_address_points_at_cluster_address():
    with pytest.raises(Exception, match=r"ray.address: 'auto': the cluster's address is cluster.address now"):
        load_config(RLConfig, [str(ROOT / "recipes/rl/tiny.yaml"), "ray.address=auto"])


def test_the_pipeline_cluster_reaches_every_training_stage_and_a_stage_override_wins(tmp_path):
    recipe = tmp_path / "p.yaml"
    recipe.write_text(yaml.safe_dump({"name": "t", "output_root": str(tmp_path), "cluster": {"strategy": "SPREAD"}, "stages": [
        {"name": "base", "stage": "tiny_model"},
        {"name": "sft", "stage": "sft", "recipe": "recipes/sft/tiny.yaml", "inputs": {"base": "base"}},
        {"name": "rl", "stage": "rl", "recipe": "recipes/rl/tiny.yaml", "inputs": {"policy": "sft"},
         "overrides": {"cluster.strategy": "PACK"}},
    ]}))
    by = {s.spec.name: s.config for s in plan(recipe, cluster_address="head:6379").stages}
    assert not hasattr(by["base"], "cluster")
    assert (by["sft"].cluster.address, by["sft"].cluster.strategy) == ("head:6379", "SPREAD")
    assert (by["rl"].cluster.address, by["rl"].cluster.strategy) == ("head:6379", "PACK")
    unset = {s.spec.name: s.config for s in plan(recipe).stages}
    assert unset["sft"].cluster.address is None


def test_an_address_nothing_listens_on_is_refused_at_once():
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.time()
    with pytest.raises(ClusterError, match=rf"cluster.address: '127.0.0.1:{port}': nothing accepts a connection there"):
        join(f"127.0.0.1:{port}")
    assert time.time() - start < 5
    with pytest.raises(ClusterError, match="expected the address of a running Ray cluster's head"):
        join("not-an-address")


def test_a_driver_with_the_cluster_s_token_sends_it():
    from stages.common.cluster import driver_auth

    for given, mode in [({"RAY_AUTH_TOKEN": "t"}, "token"), ({"RAY_AUTH_TOKEN_PATH": "/x"}, "token"),
                        ({"RAY_AUTH_TOKEN": "t", "RAY_AUTH_MODE": "disabled"}, "disabled"), ({}, None)]:
        env = dict(given)
        driver_auth(env)
        assert env.get("RAY_AUTH_MODE") == mode
