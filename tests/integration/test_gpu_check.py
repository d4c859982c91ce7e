"""The prepared GPU check (bench/gpu_check.py) runs end to end here in its CPU mode: the stages' bf16 losses against
their fp32 ones, and the learner side of the broadcast checked bit-exact by a receiver process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_passes_in_its_cpu_mode(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "device=cpu", "steps=3", f"out={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["device"] == "cpu"
    for name in ("sft", "reward_model", "dpo"):
        stage = result["stages"][name]
        assert len(stage["reference_fp32_cpu"]) == len(stage["candidate_bf16"]) == 3
        assert stage["step1_rel_diff"] <= 0.02 and stage["mean_rel_diff"] <= 0.05
        assert stage["reference_fp32_cpu"] != stage["candidate_bf16"]  # two precisions really ran
    sync = result["broadcast"]
    assert sync["backend"] == "gloo" and sync["received"] == sync["tensors"] > 0 and sync["mismatched"] == []
    assert "| sft |" in r.stdout and "PASSED" in r.stdout
