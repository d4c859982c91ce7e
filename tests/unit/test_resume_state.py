"""In-stage resume state (manifest written last, verified before use, rotation), metrics, run-folder locks."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import CheckpointError
from checkpoints.state import STATE_MANIFEST, commit_state, read_json_state, resumable_state
from stages.common.stage import RunBusy, StageRun
from stages.common.trainer import kept_metric_lines

ROOT = Path(__file__).resolve().parents[2]


def _save(state: Path, step: int, payload: bytes = b"weights") -> None:
    folder = state / f"step{step}"
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "model_states.pt").write_bytes(payload + str(step).encode())
    (folder / "driver.json").write_text(json.dumps({"step": step}))


def test_committed_state_round_trips_and_old_tags_rotate(tmp_path):
    state = tmp_path / "state"
    assert resumable_state(state) is None  # nothing saved yet: a fresh start
    for step in (10, 20, 30):
        _save(state, step)
        commit_state(state, step, keep_last=2)
    m = resumable_state(state)
    assert (m.tag, m.step) == ("step30", 30) and read_json_state(state, m, "driver.json") == {"step": 30}
    assert sorted(p.name for p in state.iterdir()) == [STATE_MANIFEST, "step20", "step30"]
    assert set(m.files) == {"policy/model_states.pt", "driver.json"}


def test_a_save_killed_before_its_manifest_resumes_from_the_previous_one(tmp_path):
    state = tmp_path / "state"
    _save(state, 10)
    commit_state(state, 10)
    _save(state, 20)  # written, never committed (killed before commit_state)
    assert resumable_state(state).step == 10
    _save(state, 30)  # the resumed run saves again: the half-saved step20 goes with the rotation
    commit_state(state, 30)
    assert sorted(p.name for p in state.iterdir()) == [STATE_MANIFEST, "step30"]


@pytest.mark.parametrize("damage, message", [
    (lambda s: (s / STATE_MANIFEST).write_text(""), "state.json: unreadable resume manifest \\(empty file\\)"),
    (lambda s: (s / STATE_MANIFEST).write_text('{"tag": "step10", "st'), "state.json: unreadable resume manifest \\(Invalid JSON"),
    (lambda s: (s / "step10" / "driver.json").unlink(), "driver.json: resume state file listed in .* is missing"),
    (lambda s: (s / "step10" / "policy" / "model_states.pt").write_bytes(b"w"), "model_states.pt: 1 bytes, .* says 9 \\(truncated"),
    (lambda s: (s / "step10" / "policy" / "model_states.pt").write_bytes(b"WEIGHTS10"), "model_states.pt: sha256 differs"),
])
def test_damaged_resume_state_is_refused_by_name(tmp_path, damage, message):
    state = tmp_path / "state"
    _save(state, 10)
    commit_state(state, 10)
    damage(state)
    with pytest.raises(CheckpointError, match=message):
        resumable_state(state)


def test_metrics_torn_last_line_is_dropped_a_bad_middle_line_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [json.loads(x)["step"] for x in kept_metric_lines(path)] == [1, 2]
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a metrics record"):
        kept_metric_lines(path)


def test_a_run_folder_is_written_by_one_process_at_a_time(tmp_path):
    run = StageRun(stage="sft", key="sft-abc", output_root=str(tmp_path), parts={})
    script = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
        "from stages.common.stage import StageRun\n"
        f"run = StageRun(stage='sft', key='sft-abc', output_root={str(tmp_path)!r}, parts={{}})\n"
        "with run.claimed():\n    print('held', flush=True)\n    time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunBusy, match=f"sft-abc: another process \\(pid {holder.pid}\\) is writing this run"):
            with run.claimed():
                pass
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    with run.claimed() as folder:  # the holder is gone: its lock went with it
        assert folder == tmp_path / "sft-abc"
