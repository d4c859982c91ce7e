"""Shared fixtures: the micro model and a small copy of the built-in task, built once per session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# under pytest-xdist the cores are shared: each worker's processes get their share of OpenMP threads
# (oversubscribed OpenMP threads spin against each other)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run where CUDA exists and are skipped elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="session")
def micro_model(store):
    """A verified `full` checkpoint of the micro preset (~0.46M params) with the task tokenizer."""
    from stages.tiny_model import TinyModelConfig, run_tiny_model

    return run_tiny_model(TinyModelConfig(preset="micro", output_root=str(store)))


@pytest.fixture(scope="session")
def tokenizer(micro_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model.path)


@pytest.fixture(scope="session")
def task_files(tmp_path_factory) -> dict[str, Path]:
    from datasets_prep.synthetic import write_task_files

    sizes = {"sft": 256, "preference": 128, "preference_eval": 32, "rl_prompts": 128, "eval": 32}
    return write_task_files(tmp_path_factory.mktemp("task"), seed=0, sizes=sizes)


@pytest.fixture(scope="session")
def micro_sft(task_files, micro_model, tmp_path_factory):
    """The micro model after a short SFT (20 steps), so its distributions are far from uniform."""
    from stages.sft import SFTConfig, run_sft

    cfg = SFTConfig.model_validate({
        "data": {"paths": [str(task_files["sft"])], "input_key": "messages", "output_key": None, "max_len": 64, "packing": True},
        "train": {"dtype": "fp32", "train_batch_size": 8, "micro_train_batch_size": 8, "max_steps": 20, "lr": 5e-3,
                  "progress_bar": False},
        "output_root": str(tmp_path_factory.mktemp("micro_sft")),
    })
    return run_sft(cfg, micro_model)


def metrics(ref, initial: bool = False) -> list[dict]:
    """The step rows of a stage run's metrics.jsonl (beside its checkpoint ``ref``); ``initial=True`` adds step 0,
    the held-out eval before the first step that an RL run with eval_data logs."""
    rows = [json.loads(ln) for ln in (Path(ref.path).parent / "metrics.jsonl").read_text().splitlines()]
    assert_declared(ref, rows)
    return rows if initial else [r for r in rows if r["step"] > 0]


def assert_declared(ref, rows: list[dict]) -> None:
    """Every metric the run logged, and every number a gate can read of it (flows.gates.stage_metrics), is one its
    stage declares (StageSpec.metrics: what gates and save_best are checked against at planning)."""
    from checkpoints import read_manifest
    from flows.gates import stage_metrics
    from stages import registry

    run_dir = Path(ref.path).parent
    spec = registry.spec(read_manifest(ref.path).stage)
    config = spec.config.model_validate(json.loads((run_dir / "identity.json").read_text())["config"])
    declared = spec.metrics(config)
    if declared.open:
        return
    logged = {k for r in rows for k in r} | set(stage_metrics(ref, run_dir))
    assert logged <= declared.names, f"{spec.name} logged metrics it does not declare: {sorted(logged - declared.names)}"


def no_worker_processes(under: Path | str) -> list[str]:
    """Command lines of training ranks still alive whose run folder is under ``under``."""
    import psutil

    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "stages.common.worker" in cmd and str(under) in cmd:
            left.append(cmd)
    return left


def wandb_history(run_dir: Path) -> tuple[str, list[dict]]:
    """(run id, logged rows) of the offline W&B run under ``run_dir/wandb``: the ``.wandb`` file read as
    what it is, a LevelDB-format log of W&B's protobuf records (32 KiB blocks, 7-byte record headers)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf, rows, run_id = 7, 32768, b"", [], None
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record, MIDDLE/LAST continue it
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            which = rec.WhichOneof("record_type")
            if which == "run":
                run_id = rec.run.run_id
            elif which == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return run_id, rows
