"""The progress file behind a stage's Prefect progress artifact: steps, the last metrics, the last eval."""

from __future__ import annotations

from stages.common.progress import read_progress, report_progress


def test_progress_keeps_the_last_eval_until_the_next_one(tmp_path, monkeypatch):
    f = tmp_path / "progress.json"
    assert read_progress(f) == (None, "")
    report_progress(1, 4)  # without the variable nothing is written
    assert not f.exists()
    monkeypatch.setenv("RLHF_PROGRESS_FILE", str(f))
    report_progress(1, 4, {"loss": 2.5, "lr": 1e-3})
    assert read_progress(f) == (25.0, "step 1/4, loss 2.5")
    report_progress(2, 4, {"loss": 2.0, "eval_loss": 2.25, "eval_reward_accuracy": 0.625})
    report_progress(3, 4, {"loss": 1.5})
    assert read_progress(f) == (75.0, "step 3/4, loss 1.5; eval at step 2: loss 2.25, reward_accuracy 0.625")
    report_progress(4, 4, {"loss": 1.0, "eval_loss": 1.75})
    assert read_progress(f) == (100.0, "step 4/4, loss 1; eval at step 4: loss 1.75")
