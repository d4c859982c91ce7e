"""Every training stage on an existing Ray cluster of several nodes (``cluster.address``): a local multi-node cluster
on 127.0.0.1 (``stages.common.local_cluster``: a head with no CPUs and two 1-CPU worker nodes, token auth) stands in
for several machines. The stages join it as a user's driver would and leave it running."""

import contextlib
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from checkpoints import verify
from stages.common.cluster import ClusterError
from stages.common.recipe import apply_overrides, read_recipe, validate
from stages.dpo import DPOConfig, run_dpo
from stages.rl.config import RLConfig
from stages.rl.driver import run_rl
from stages.sft import SFTConfig, run_sft
from tests.conftest import metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LocalCluster:
    address: str
    nodes: list[dict]  # {"name", "node_id", "raylet_pid"}
    gcs_pid: int
    proc: subprocess.Popen
    hidden: Path  # node1 can't see paths under here (its processes get RLHF_FAULT_HIDE_PATHS)
    env: dict[str, str]
    info: Path

    def processes(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def add_node(self, name: str) -> dict:
        self.proc.stdin.write(f"add {name}\n")
        self.proc.stdin.flush()
        deadline = time.time() + 120
        while time.time() < deadline:
            nodes = json.loads(self.info.read_text())["nodes"]
            if any(n["name"] == name for n in nodes):
                self.nodes = nodes
                return nodes[-1]
            time.sleep(0.5)
        raise AssertionError(f"node {name} did not join")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")
    info, hidden = folder / "info.json", folder / "hidden"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    log = open(folder / "cluster.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "stages.common.local_cluster", "--nodes", "2", "--info", str(info), "--stdin",
                             "--node-env", f"node1:RLHF_FAULT_HIDE_PATHS={hidden}"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (info.is_file() and len(json.loads(info.read_text())["nodes"]) == 2):
        assert proc.poll() is None, (folder / "cluster.log").read_text()
        time.sleep(0.5)
    data = json.loads(info.read_text())
    mp = pytest.MonkeyPatch()
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # this process joins as a user's driver: the cluster's token
        mp.setenv(k, env[k])
    mp.delenv("RAY_AUTH_MODE")  # as the README's shell has it: the token only (join sets the mode)
    mp.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    lc = LocalCluster(data["address"], data["nodes"], data["gcs_pid"], proc, hidden, env, info)
    try:
        yield lc
    finally:
        mp.undo()
        started = lc.processes()
        proc.stdin.close()
        proc.wait(timeout=120)
        log.close()
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [p.pid for p in alive]  # no Ray process is left after the tests


def _sft(task_files, root: Path, address: str | None, **train) -> SFTConfig:
    return SFTConfig.model_validate({
        "data": {"paths": [str(task_files["sft"])], "input_key": "messages", "output_key": None, "max_len": 64, "packing": True},
        "train": {"world_size": 2, "zero_stage": 3, "dtype": "fp32", "train_batch_size": 8, "micro_train_batch_size": 2,
                  "max_steps": 4, "lr": 3e-3, "warmup_ratio": 0.0, "progress_bar": False, **train},
        "cluster": {"address": address, "strategy": "STRICT_SPREAD"},
        "output_root": str(root),
    })


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_sft(task_files, micro_model, tmp_path_factory):
    """The reference: the same two-rank run as local processes (today's launcher)."""
    return run_sft(_sft(task_files, tmp_path_factory.mktemp("local"), None), micro_model)


def _nodes(run_dir: Path, role: str) -> list[str]:
    return [r["node_id"] for r in json.loads((run_dir / "placement.json").read_text())[role]]


def test_sft_two_ranks_on_two_nodes_equals_the_local_run(cluster, task_files, micro_model, local_sft, tmp_path):
    ref = run_sft(_sft(task_files, tmp_path, cluster.address), micro_model)
    verify(ref)
    run_dir = Path(ref.path).parent
    ranks = _nodes(run_dir, "ranks")
    assert len(set(ranks)) == 2 and set(ranks) <= {n["node_id"] for n in cluster.nodes}  # one rank per worker node
    ours, local = _losses(run_dir), _losses(Path(local_sft.path).parent)
    assert len(ours) == 4 and max(abs(a - b) for a, b in zip(ours, local)) <= 1e-5
    a, b = load_file(str(Path(ref.path) / "model.safetensors")), load_file(str(Path(local_sft.path) / "model.safetensors"))
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    # the cluster's address is not part of the run identity: the same run folder name
    assert run_dir.name == Path(local_sft.path).parent.name
    # every server of the cluster listens on loopback only
    bound = {c.laddr.ip for p in cluster.processes() for c in _listening(p)}
    assert bound and all(_loopback(ip) for ip in bound), bound
    assert all(p.is_running() for p in cluster.processes()[:3])  # the stage left the cluster running


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def _listening(p: psutil.Process) -> list:
    try:
        return [c for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


def test_dpo_two_ranks_on_two_nodes_completes_and_verifies(cluster, task_files, micro_sft, tmp_path):
    cfg = DPOConfig.model_validate({
        "data": {"paths": [str(task_files["preference"])], "max_len": 64},
        "train": {"world_size": 2, "zero_stage": 3, "dtype": "fp32", "train_batch_size": 8, "micro_train_batch_size": 2,
                  "max_steps": 3, "lr": 3e-3, "warmup_ratio": 0.0, "progress_bar": False},
        "cluster": {"address": cluster.address, "strategy": "STRICT_SPREAD"},
        "output_root": str(tmp_path),
    })
    ref = run_dpo(cfg, micro_sft)
    verify(ref)
    assert len(set(_nodes(Path(ref.path).parent, "ranks"))) == 2
    rows = metrics(ref)
    assert len(rows) == 3 and rows[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # policy == reference at step 1


def test_rl_learner_and_engine_on_different_nodes_train_with_verified_pushes(cluster, task_files, micro_sft, tmp_path):
    data, _ = read_recipe(ROOT / "recipes/rl/tiny.yaml")
    cfg = validate(RLConfig, apply_overrides(data, [
        f"data.paths=[{task_files['rl_prompts']}]", "eval_data=null", "eval_steps=0", f"output_root={tmp_path}",
        "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6", "train.world_size=1",
        "train.train_batch_size=16", "train.micro_train_batch_size=8", "train.progress_bar=false", "max_steps=3",
        f"reward.func={ROOT / 'recipes/rewards/arithmetic.py'}", f"cluster.address={cluster.address}",
        "cluster.strategy=STRICT_SPREAD"]), "recipes/rl/tiny.yaml")
    ref = run_rl(cfg, micro_sft)
    verify(ref)
    run_dir = Path(ref.path).parent
    learners, engines = _nodes(run_dir, "learners"), _nodes(run_dir, "engines")
    assert len(learners) == len(engines) == 1 and learners[0] != engines[0]
    steps = metrics(ref)
    assert [s["step"] for s in steps] == [1, 2, 3]
    # every push was broadcast across nodes (learner rank 0 to the engine worker) and matched the learner on the probe
    assert all(s["sync_logprob_diff"] <= 1e-3 and s["sync_max_logprob_diff"] <= 1e-2 for s in steps)


def test_an_output_root_one_node_cannot_see_is_refused_before_training(cluster, task_files, micro_model):
    node1 = next(n for n in cluster.nodes if n["name"] == "node1")
    with pytest.raises(ClusterError, match=rf"node {node1['node_id']} \(127.0.0.1\) can't see {cluster.hidden}/sft-\w+") as e:
        run_sft(_sft(task_files, cluster.hidden, cluster.address), micro_model)
    assert "shared volume" in str(e.value)
    assert not list(cluster.hidden.glob("*/metrics.jsonl")) and not list(cluster.hidden.glob("*/checkpoint"))


def test_the_pipeline_with_eval_on_the_cluster_then_all_cached(cluster, task_files, tmp_path):
    stages = [
        {"name": "base", "stage": "tiny_model", "overrides": {"preset": "micro"}},
        {"name": "sft", "stage": "sft", "recipe": "recipes/sft/tiny.yaml", "inputs": {"base": "base"},
         "overrides": {"data.paths": [str(task_files["sft"])], "train.max_steps": 2, "train.world_size": 2,
                       "train.micro_train_batch_size": 8, "train.progress_bar": False}},
        {"name": "dpo", "stage": "dpo", "recipe": "recipes/dpo/tiny.yaml", "inputs": {"policy": "sft"},
         "overrides": {"data.paths": [str(task_files["preference"])], "train.max_steps": 2, "train.progress_bar": False}},
        {"name": "rl", "stage": "rl", "recipe": "recipes/rl/tiny.yaml", "inputs": {"policy": "sft"},
         "overrides": {"data.paths": [str(task_files["rl_prompts"])], "max_steps": 2, "eval_steps": 0, "eval_data": None,
                       "rollout.rollout_batch_size": 8, "rollout.n_samples_per_prompt": 4, "train.train_batch_size": 32,
                       "train.micro_train_batch_size": 16, "train.progress_bar": False}},
        {"name": "eval", "stage": "eval", "recipe": "recipes/eval/tiny.yaml", "inputs": {"models": ["sft", "rl"], "reference": "sft"},
         "overrides": {"data.paths": [str(task_files["eval"])], "data.max_samples": 16, "num_samples": 2, "pass_k": 2,
                       "max_new_tokens": 8}},
    ]
    recipe = tmp_path / "pipeline.yaml"
    recipe.write_text(yaml.safe_dump({"name": "on-cluster", "output_root": str(tmp_path / "runs"), "stages": stages}))
    # Prefect's telemetry off by the project itself (flows/__init__.py), not by the caller's environment
    # (and its cached results under PREFECT_HOME by the project too: `make test` exports the project's storage path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_LOCAL_STORAGE_PATH")} | {"PREFECT_HOME": str(tmp_path / "prefect")}

    def run() -> str:
        out = subprocess.run([sys.executable, "-m", "flows.full_rlhf", str(recipe), "--cluster", cluster.address],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        return out.stdout + out.stderr

    log = run()
    assert not [ln for ln in log.splitlines() if re.search(r"\bERROR\b", ln)], log[-3000:]  # a clean run logs no ERROR line
    # RL's 2 steps from this 2-step SFT model earned no reward: said, per step and of the output (not failed: the
    # default allows 10 such steps in a row)
    assert "[rl] WARNING: no learning signal at step 1: every reward was 0" in log
    assert "[rl] WARNING: the output checkpoint has the same content digest as its input 'policy'" in log
    for stage in ("sft", "dpo", "rl"):  # each training stage ran on the cluster
        (run_dir,) = (tmp_path / "runs").glob(f"{stage}-*")
        assert (run_dir / "placement.json").is_file(), stage
    assert len(set(_nodes(next((tmp_path / "runs").glob("sft-*")), "ranks"))) == 2
    (eval_dir,) = (tmp_path / "runs").glob("eval-*")
    # the generation (one per distinct checkpoint: RL's 2 steps from this 2-step SFT model earned no reward, so no
    # update: its weights are SFT's) and the scoring ran on the cluster
    assert list(eval_dir.glob("generate-*/placement.json")) and (eval_dir / "score" / "placement.json").is_file()
    assert json.loads(next(eval_dir.rglob("metrics.json")).read_text())["sft"]["kl_to_reference"] == pytest.approx(0.0, abs=1e-4)
    second = run()
    for name in ("base", "sft", "dpo", "rl", "eval"):
        assert f"Task run '{name}' - Finished in state Cached" in second, second[-3000:]
    # the cache they came from is this PREFECT_HOME's (flows/__init__.py), not ~/.prefect/storage shared by every project
    records = {p.name for p in (tmp_path / "prefect" / "storage").iterdir()}
    assert {d.name for d in (tmp_path / "runs").glob("*-*") if d.is_dir()} <= records, records


def test_a_node_lost_mid_sft_fails_the_stage_naming_it_and_the_rerun_resumes(cluster, task_files, micro_model, local_sft, tmp_path):
    """Rank 1 holds after step 2 (its state committed at steps 1 and 2) while its node goes (its raylet and every process
    under it SIGKILLed, as when the machine dies; a hung worker outlives its raylet alone): the stage
    fails within its deadline naming that node; the head and the other node stay up; on a replacement node the
    rerun (train.resume=true) resumes from step 2 and ends with the uninterrupted run's losses."""
    args = [sys.executable, "-m", "stages.sft", str(ROOT / "recipes/sft/tiny.yaml"), "base=" + micro_model.path,
            f"data.paths=[{task_files['sft']}]", "train.world_size=2", "train.zero_stage=3", "train.train_batch_size=8",
            "train.micro_train_batch_size=2", "train.max_steps=4", "train.lr=3e-3", "train.warmup_ratio=0.0",
            "train.lr_scheduler=cosine", "train.min_lr_ratio=0.1", "train.save_steps=1", "train.keep_last=2",
            "train.progress_bar=false", "train.timeout_s=300", f"output_root={tmp_path}", f"cluster.address={cluster.address}",
            "cluster.strategy=STRICT_SPREAD"]
    env = {**os.environ, "RLHF_FAULT_STEP": "2", "RLHF_FAULT_RANK": "1", "RLHF_FAULT_MODE": "hang"}
    log = tmp_path / "stage.log"
    with open(log, "w") as f:
        stage = subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and not list(tmp_path.glob("sft-*/state/step2")):
        assert stage.poll() is None, log.read_text()[-4000:]
        time.sleep(0.5)
    (run_dir,) = tmp_path.glob("sft-*")
    victim = _nodes(run_dir, "ranks")[1]
    node = next(n for n in cluster.nodes if n["node_id"] == victim)
    raylet = psutil.Process(node["raylet_pid"])
    machine = [raylet, *raylet.children(recursive=True)]  # the node's raylet, agents and workers: the machine goes
    killed = time.time()
    for p in machine:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(machine, timeout=10)
    stage.wait(timeout=180)
    out = log.read_text()
    assert stage.returncode != 0
    assert time.time() - killed < 120
    assert f"rank(s) [1] lost: node {victim} (127.0.0.1) left the cluster" in out, out[-4000:]
    survivors = [n for n in cluster.nodes if n["node_id"] != victim]
    assert psutil.pid_exists(cluster.gcs_pid) and all(psutil.pid_exists(n["raylet_pid"]) for n in survivors)
    cluster.add_node("node2")
    rerun = subprocess.run([*args, "train.resume=true"], cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-2:] == [3, 4]  # resumed after step 2
    expected = _losses(Path(local_sft.path).parent)
    assert max(abs(r["loss"] - expected[r["step"] - 1]) for r in rows) <= 1e-5


def test_the_local_cluster_runs_in_the_background_until_stopped(tmp_path):
    """Started as the README says (in the background, stdin closed), it stays up; ``stop --info`` ends it and every
    process of it."""
    info = tmp_path / "c.json"
    env = {**os.environ, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_AUTH_MODE", None)
    help_text = subprocess.run([sys.executable, "-m", "stages.common.local_cluster", "--help"], cwd=ROOT, capture_output=True,
                               text=True).stdout
    assert "stop --info FILE" in help_text and "SIGTERM" in help_text
    proc = subprocess.Popen([sys.executable, "-m", "stages.common.local_cluster", "--nodes", "1", "--info", str(info)], cwd=ROOT,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (info.is_file() and len(json.loads(info.read_text())["nodes"]) == 1):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    ray_procs = psutil.Process(proc.pid).children(recursive=True)
    time.sleep(3)
    assert proc.poll() is None  # stdin closed: still up
    assert ray_procs and json.loads(info.read_text())["pid"] == proc.pid
    out = subprocess.run([sys.executable, "-m", "stages.common.local_cluster", "stop", "--info", str(info)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and f"stopped (pid {proc.pid})" in out.stdout, out.stderr
    assert proc.wait(timeout=10) == 0 and "stop: python -m stages.common.local_cluster stop --info" in proc.stdout.read()
    _, alive = psutil.wait_procs(ray_procs, timeout=30)
    assert alive == [], [p.cmdline() for p in alive]
