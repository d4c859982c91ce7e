"""The GPU check: what of the GPU paths can run on a GPU machine that has PyTorch, transformers, peft and DeepSpeed
but neither vLLM nor Ray (the machines this project is lent have no room for their wheels). One command, a few
minutes on one H100/H200:

1. **Stages on CUDA in bf16.** SFT, the reward model and DPO (their recipes, ``recipes/*/tiny.yaml``, ``steps``
   optimizer steps, one DeepSpeed rank) run on the GPU in bf16 and, in the same command, on the CPU in fp32 (the
   CPU accelerator, gloo). Their per-step losses must agree: the first step within ``STEP1_TOL`` (2%, relative:
   same weights and batch, bf16 rounding only) and the mean over the steps within ``MEAN_TOL`` (5%, relative:
   bf16 trajectories drift slowly).
2. **The learner side of the weight broadcast** (``stages.rl.broadcast``): a learner process (a DeepSpeed ZeRO-3
   engine on the GPU, gathered module by module) broadcasts the policy to a receiver process, which checks every
   tensor bit-exact against the checkpoint in bf16. NCCL between the two GPUs when there are two; on one GPU
   NCCL can't put two ranks on one device, so the backend is gloo (``sync.backend: gloo`` on GPUs: tensors
   through host memory) and NCCL is reported as not run. Then ``train.enable_sleep``'s hand-over: the learner's
   ``offload_states`` must free GPU memory and ``reload_states`` bring it back.

``device=cpu`` runs the same on a CPU machine (fp32 reference vs CPU bf16, gloo): how the check itself is tested.
Prints a table; writes ``bench/results/gpu_check.json``; exits 1 when a check fails.

Run: ``python -m bench.gpu_check [steps=20] [device=cuda|cpu] [preset=tiny] [out=PATH]``
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "gpu_check.json"
STEP1_TOL, MEAN_TOL = 0.02, 0.05
STAGES = ("sft", "reward_model", "dpo")
BUCKET = 256 * 2**20  # sync.bucket_mb's default


@contextmanager
def cpu_only():
    """The stage's rank processes see no GPU and use DeepSpeed's CPU accelerator (gloo)."""
    from stages.common.cluster import restored_env

    with restored_env(("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")):
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        yield


def run_stage(name: str, base, root: Path, dtype: str, steps: int) -> list[float]:
    """One stage from its recipe, ``steps`` optimizer steps in ``dtype`` on whatever its ranks see; its step losses."""
    from stages.common.recipe import load_config
    from stages.registry import spec as stage_spec

    spec = stage_spec(name)
    cfg = load_config(spec.config, [str(ROOT / f"recipes/{name}/tiny.yaml"), f"output_root={root}", f"train.max_steps={steps}",
                                    f"train.dtype={dtype}", "train.progress_bar=false", "train.save_steps=0"])
    ref = spec.run(cfg, base)
    rows = [json.loads(ln) for ln in (Path(ref.path).parent / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("step", 0) > 0 and "loss" in r]


def compare(reference: list[float], candidate: list[float]) -> dict:
    rel = [abs(c - r) / max(abs(r), 1e-8) for r, c in zip(reference, candidate, strict=True)]
    step1, mean = rel[0], abs(sum(candidate) - sum(reference)) / max(abs(sum(reference)), 1e-8)
    return {"reference_fp32_cpu": reference, "candidate_bf16": candidate, "step1_rel_diff": round(step1, 5),
            "mean_rel_diff": round(mean, 5), "max_step_rel_diff": round(max(rel), 5),
            "passed": step1 <= STEP1_TOL and mean <= MEAN_TOL}


def stage_checks(base, device: str, steps: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in STAGES:
            with cpu_only():
                reference = run_stage(name, base, Path(tmp) / "fp32", "fp32", steps)
            t = time.perf_counter()
            if device == "cpu":
                with cpu_only():
                    candidate = run_stage(name, base, Path(tmp) / "bf16", "bf16", steps)
            else:
                candidate = run_stage(name, base, Path(tmp) / "bf16", "bf16", steps)
            out[name] = {**compare(reference, candidate), "candidate_s": round(time.perf_counter() - t, 1)}
    return out


def _sender(model_path: str, port: int, group_port: int, backend: str, device: str, queue) -> None:
    """The learner side: a ZeRO-3 DeepSpeed engine (world size 1) broadcasting its weights module by module."""
    import torch

    if device == "cpu":
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from transformers import AutoModelForCausalLM

    from stages.common import trainer
    from stages.common.config import LoraConfig, TrainConfig
    from stages.rl.broadcast import named_weights, open_group, send, sync_device, weight_meta

    trainer.init_distributed()
    train = TrainConfig(zero_stage=3, dtype="bf16", train_batch_size=1, micro_train_batch_size=1)
    eng = trainer.build_engine(model_path, train, LoraConfig(), 10,
                               lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, use_safetensors=True))
    module = eng.engine.module
    meta = weight_meta(module, False, True, "bfloat16")
    queue.put(("meta", meta))
    group = open_group("127.0.0.1", group_port, 0, 2, backend, 120)
    t = time.perf_counter()
    n = send(group, named_weights(module, False, True), meta, sync_device(backend), BUCKET)
    if backend == "nccl":
        torch.cuda.synchronize()
    result = {"tensors": len(meta), "broadcasts": n, "push_s": round(time.perf_counter() - t, 4)}
    if device != "cpu":  # train.enable_sleep's hand-over
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        eng.engine.offload_states()
        torch.cuda.synchronize()
        offloaded = torch.cuda.memory_allocated()
        eng.engine.reload_states()
        torch.cuda.synchronize()
        result.update(gpu_bytes_before=before, gpu_bytes_offloaded=offloaded, gpu_bytes_reloaded=torch.cuda.memory_allocated())
    queue.put(("sender", result))


def _receiver(model_path: str, group_port: int, backend: str, device: str, meta, queue) -> None:
    """The engine side without vLLM: receive every tensor and compare it with the checkpoint's, in bf16."""
    import torch
    from safetensors.torch import load_file

    from stages.rl.broadcast import open_group, receive

    if backend == "nccl":
        torch.cuda.set_device(1)
    where = torch.device("cuda", 1) if backend == "nccl" else torch.device("cpu")
    group = open_group("127.0.0.1", group_port, 1, 2, backend, 120)
    expected = load_file(str(Path(model_path) / "model.safetensors"))
    mismatched, received, nbytes = [], 0, 0
    for name, tensor in receive(group, meta, where, BUCKET):
        received += 1
        nbytes += tensor.numel() * tensor.element_size()
        if not torch.equal(tensor.cpu(), expected[name].to(torch.bfloat16)):
            mismatched.append(name)
    queue.put(("receiver", {"received": received, "bytes": nbytes, "mismatched": mismatched}))


def broadcast_check(model_path: str, device: str) -> dict:
    import multiprocessing as mp

    import torch

    from stages.common.launcher import free_port

    gpus = torch.cuda.device_count() if device != "cpu" else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, group_port = free_port(), free_port()
    sender = ctx.Process(target=_sender, args=(model_path, port, group_port, backend, device, queue))
    sender.start()
    got = {}
    kind, meta = queue.get(timeout=600)
    receiver = ctx.Process(target=_receiver, args=(model_path, group_port, backend, device, meta, queue))
    receiver.start()
    for _ in range(2):
        kind, value = queue.get(timeout=600)
        got[kind] = value
    sender.join(60)
    receiver.join(60)
    s, r = got["sender"], got["receiver"]
    out = {"backend": backend, "nccl": "ran (two GPUs)" if backend == "nccl" else
           ("not run: one GPU (NCCL needs a GPU per rank)" if device != "cpu" else "not run: CPU"),
           **s, **r, "push_mb_per_s": round(r["bytes"] / 2**20 / max(s["push_s"], 1e-9), 1)}
    sleep_ok = True
    if "gpu_bytes_offloaded" in s:
        sleep_ok = s["gpu_bytes_offloaded"] < s["gpu_bytes_before"] and s["gpu_bytes_reloaded"] >= s["gpu_bytes_before"] * 0.99
        out["offload_passed"] = sleep_ok
    out["passed"] = r["received"] == len(meta) and not r["mismatched"] and sleep_ok
    return out


def main(argv: list[str] | None = None) -> None:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    import torch

    device = args.get("device", "cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device=cuda: this machine has no CUDA GPU (device=cpu runs the check on CPU)")
    steps = int(args.get("steps", 20))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stages.tiny_model import TinyModelConfig, run_tiny_model

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = run_tiny_model(TinyModelConfig(preset=args.get("preset", "tiny"), output_root=tmp))
        stages = stage_checks(base, device, steps)
        sync = broadcast_check(base.path, device)
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
              "steps": steps, "tolerances": {"step1_rel": STEP1_TOL, "mean_rel": MEAN_TOL}, "stages": stages,
              "broadcast": sync, "seconds": round(time.perf_counter() - started, 1)}
    result["passed"] = all(v["passed"] for v in stages.values()) and sync["passed"]
    print(f"\nGPU check on {result['device']} (torch {result['torch']}), {steps} steps; bf16 on {device} vs fp32 on CPU\n")
    print("| stage | step-1 rel. diff | mean rel. diff | max step rel. diff | passed |\n|---|---|---|---|---|")
    for name, v in stages.items():
        print(f"| {name} | {v['step1_rel_diff']} | {v['mean_rel_diff']} | {v['max_step_rel_diff']} | {v['passed']} |")
    print(f"\nbroadcast ({sync['backend']}; NCCL {sync['nccl']}): {sync['received']} tensors, {sync['bytes'] / 2**20:.1f} MiB in "
          f"{sync['push_s']} s, bit-exact: {not sync['mismatched']}" +
          (f"; offload_states frees {sync['gpu_bytes_before'] - sync['gpu_bytes_offloaded']} bytes: {sync['offload_passed']}"
           if "offload_passed" in sync else ""))
    out = Path(args["out"]) if "out" in args else OUT if device == "cuda" else OUT.with_name("gpu_check_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'PASSED' if result['passed'] else 'FAILED'} in {result['seconds']} s; wrote {out}")
    if not result["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
