"""A new user's first hour: --help from the config, "did you mean", one-line errors, every check before anything
starts (a pipeline with a missing file, a closed reward port or a bad --refresh fails in seconds with no Prefect
server, Ray or vLLM started), earlier outputs by name, a quiet offline log."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stages.common.recipe import RecipeError, validate

ROOT = Path(__file__).resolve().parents[2]


def cli(module: str, *args: str, env: dict | None = None, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, **(env or {})}, timeout=120)
    return out, time.monotonic() - start


def test_help_lists_every_field_with_type_default_and_description(capsys):
    from stages.rl.driver import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m stages.rl [RECIPE.yaml] [KEY=VALUE ...]")
    assert "log_rollouts_every (int, default 0):\n    write a step's samples to rollouts/step_N.jsonl every N steps" in text
    assert "  advantage_estimator (str, default 'group_norm'):" in text and "TRL's 'grpo'" in text
    assert "  zero_stage (0 | 1 | 2 | 3, default 3):" in text  # RL's own default for its learners, not the shared 2
    assert "\n  max_steps (" not in text.split("\ntrain (")[1].split("\nlora (")[0]  # refused in RL: not listed

    with pytest.raises(SystemExit):
        main(["--help", "rollout"])
    section = capsys.readouterr().out
    assert section.startswith("rollout (RolloutConfig)") and "  max_new_tokens (int, default 16):" in section
    assert "log_rollouts_every" not in section

    with pytest.raises(SystemExit) as e:
        main(["--help", "rollout.max_new_tokns"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("python -m stages.rl: --help rollout.max_new_tokns: no field 'max_new_tokns' in "
                                               "RolloutConfig; did you mean 'max_new_tokens'?")


def test_did_you_mean_for_unknown_keys_and_registry_names():
    from stages.dpo import DPOConfig
    from stages.rl.config import RLConfig

    data = {"data": {"paths": ["p.jsonl"]}}
    with pytest.raises(RecipeError, match=r"algo: advantage_estimator: 'grpo' is unknown; valid: dr_grpo, gae, group_norm, "
                                          r"reinforce, reinforce_baseline, rloo; did you mean 'group_norm'\?"):
        validate(RLConfig, {**data, "algo": {"advantage_estimator": "grpo"}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"did you mean 'reinforce_baseline'\?"):
        validate(RLConfig, {**data, "algo": {"advantage_estimator": "reinforce++-baseline"}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"rollout\.n_sample_per_prompt: unknown key \(value 8\); did you mean 'n_samples_per_prompt'\?"):
        validate(RLConfig, {**data, "rollout": {"n_sample_per_prompt": 8}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"  bta: unknown key \(value 0.1\); did you mean 'beta'\?"):
        validate(DPOConfig, {**data, "bta": 0.1}, "r.yaml")


def test_a_cli_error_is_its_message_alone_exit_2_and_debug_shows_the_traceback(tmp_path):
    out, _ = cli("stages.sft", str(ROOT / "recipes/sft/tiny.yaml"), "data.paths=[missing/sft.jsonl]", cwd=tmp_path)
    assert out.returncode == 2
    expected = (f"python -m stages.sft: data.paths: missing/sft.jsonl: file not found (looked for {tmp_path}/missing/sft.jsonl; "
                f"relative paths resolve against the working directory {tmp_path})")
    assert out.stderr.strip() == expected, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    debug, _ = cli("stages.sft", str(ROOT / "recipes/sft/tiny.yaml"), "data.paths=[missing/sft.jsonl]", "--debug", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "DataError: data.paths: missing/sft.jsonl" in debug.stderr


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


@pytest.mark.parametrize("case", ["missing data file", "closed reward port", "bad --refresh", "bad --set stage"])
def test_a_pipeline_fails_before_anything_starts(case, tmp_path):
    """Checked in the plan, before Prefect's server (no database is even created), Ray or vLLM start: each
    fails within 10 s with one line naming the stage, the field and the value."""
    prefect_home = tmp_path / "prefect"
    args = {"missing data file": ["--set", "dpo.data.paths=[nowhere/pairs.jsonl]"],
            "closed reward port": ["--set", f"rl.reward.url=http://127.0.0.1:{closed_port()}/get_reward", "--set", "rl.reward.func=null"],
            "bad --refresh": ["--refresh", "sft,dpoo"],
            "bad --set stage": ["--set", "sfft.train.lr=1"]}[case]
    out, took = cli("flows.full_rlhf", *args, "--output-root", str(tmp_path / "runs"), env={"PREFECT_HOME": str(prefect_home)})
    expected = {"missing data file": "stages[3] (dpo): data.paths: nowhere/pairs.jsonl: file not found (looked for "
                                     f"{ROOT}/nowhere/pairs.jsonl; relative paths resolve against the working directory {ROOT})",
                "closed reward port": "stages[4] (rl): reward.url: http://127.0.0.1:",
                "bad --refresh": "--refresh: no stage named 'dpoo' in recipes/pipelines/tiny.yaml; did you mean 'dpo'?",
                "bad --set stage": "overrides for stages ['sfft'] that the pipeline does not have; did you mean 'sft'?"}[case]
    assert out.returncode == 2 and expected in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert took < 10, took
    assert not (prefect_home / "prefect.db").exists() and not (tmp_path / "runs").exists()
    assert "Starting temporary server" not in out.stdout + out.stderr
    if case == "closed reward port":
        assert "nothing accepts connections" in out.stderr and "start the reward server first" in out.stderr


def test_latest_names_the_newest_committed_output_of_a_stage(tmp_path, micro_model):
    from checkpoints import CheckpointError, commit, staging
    from stages.common.models import resolve_model

    def fake_run(key: str, text: str):  # two committed SFT outputs, the second one newer
        dest = tmp_path / f"sft-{key}" / "checkpoint"
        with staging(dest) as tmp:
            (tmp / "model.txt").write_text(text)
            return commit(tmp, dest, stage="sft", kind="full", config_hash=key)

    older = fake_run("aaaa", "old")
    time.sleep(0.01)
    newer = fake_run("bbbb", "new")
    assert older.digest != newer.digest
    assert resolve_model("latest:sft", str(tmp_path)).digest == newer.digest
    with pytest.raises(CheckpointError, match=r"latest:dpo: no committed dpo checkpoint under .* \(stages with one there: \['sft'\]\)"):
        resolve_model("latest:dpo", str(tmp_path))
    # in a stage's inputs: the resolved checkpoint's digest is what enters the run identity
    from stages.dpo import SPEC

    config = validate(SPEC.config, {"base": "latest:sft", "data": {"paths": ["p.jsonl"]}, "output_root": str(tmp_path)}, "r.yaml")
    inputs = SPEC.resolve_inputs(config, {})
    assert inputs["policy"].digest == newer.digest
    # another output root's, by name: latest:<stage>@<root>, verified where it is (nothing copied)
    mine = tmp_path / "mine"
    mine.mkdir()
    config = validate(SPEC.config, {"base": f"latest:sft@{tmp_path}", "data": {"paths": ["p.jsonl"]}, "output_root": str(mine)}, "r.yaml")
    policy = SPEC.resolve_inputs(config, {})["policy"]
    assert (policy.digest, policy.path) == (newer.digest, newer.path) and list(mine.iterdir()) == []
    with pytest.raises(CheckpointError, match=rf"latest:sft: no committed sft checkpoint under {mine}"):
        resolve_model("latest:sft", str(mine))
    with pytest.raises(CheckpointError, match=r"latest:sft@/nowhere: /nowhere is not a folder"):
        resolve_model("latest:sft@/nowhere", str(mine))
    (Path(newer.path) / "model.txt").write_text("tampered")
    with pytest.raises(CheckpointError):
        resolve_model(f"latest:sft@{tmp_path}", str(mine))


def test_no_signal_metrics_and_their_reason():
    from stages.rl.metrics import no_signal_reason, signal_metrics

    def exp(rewards, adv_rows):
        mask = torch.ones(len(rewards), 3)
        return SimpleNamespace(shaped=torch.tensor(rewards), advantages=torch.tensor(adv_rows, dtype=torch.float32).repeat_interleave(3).view(-1, 3),
                               samples=SimpleNamespace(response_mask=mask))

    silent = exp([0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0])
    assert signal_metrics(silent, 2, True) == {"zero_std_share": 1.0, "zero_advantage_share": 1.0, "no_signal": 1.0}
    assert no_signal_reason(silent, 2) == "every reward was 0"
    half = exp([1.0, 0.0, 1.0, 1.0], [0.7, -0.7, 0, 0])
    assert signal_metrics(half, 2, True) == {"zero_std_share": 0.5, "zero_advantage_share": 0.5, "no_signal": 0.0}
    flat_groups = exp([1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0])
    assert signal_metrics(flat_groups, 2, True)["no_signal"] == 1.0  # GRPO: each group alike -> nothing to learn
    assert signal_metrics(flat_groups, 2, False)["no_signal"] == 0.0  # REINFORCE++: the batch still has two values
    assert no_signal_reason(flat_groups, 2) == "every group of 2 samples got equal rewards (values seen: 0, 1)"


def test_the_progress_artifact_shows_a_step_warning(tmp_path, monkeypatch):
    from stages.common.progress import read_progress, report_progress

    path = tmp_path / "progress.json"
    monkeypatch.setenv("RLHF_PROGRESS_FILE", str(path))
    report_progress(1, 4, {"reward_mean": 0.0}, warning="no learning signal at step 1: every reward was 0")
    assert read_progress(path) == (25.0, "step 1/4, reward_mean 0; WARNING: no learning signal at step 1: every reward was 0")
    report_progress(2, 4, {"reward_mean": 0.5})
    assert read_progress(path)[1] == "step 2/4, reward_mean 0.5"


def test_an_output_equal_to_its_input_is_named():
    from checkpoints import CheckpointRef
    from stages.common.stage import unchanged_inputs

    ref = CheckpointRef(path="/x", stage="sft", kind="full", digest="d" * 64, config_hash="k")
    same = ref.model_copy(update={"path": "/y", "stage": "rl"})
    other = ref.model_copy(update={"digest": "e" * 64})
    assert unchanged_inputs(same, {"policy": ref, "reward_model": other, "critic": None}) == ["policy"]
    assert unchanged_inputs(other, {"policy": ref}) == []


def test_flows_turn_prefect_telemetry_off():
    out = subprocess.run([sys.executable, "-c", "import flows, os; print(os.environ['PREFECT_SERVER_ANALYTICS_ENABLED'])"],
                         capture_output=True, text=True, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_ANALYTICS_ENABLED"})
    assert out.stdout.strip() == "false"  # a whole flow run's log without an ERROR line: test_cluster's pipeline test


def test_cached_results_live_under_prefect_home(tmp_path):
    """Prefect 3.7 resolves its result storage to ~/.prefect/storage whatever PREFECT_HOME says (PrefectHQ/prefect#23046):
    two clones then shared one cache, and a fresh clone's `make run` was handed another clone's checkpoints. The
    flows package and the Makefile put the results under PREFECT_HOME; a storage path the user sets wins."""
    code = "import flows\nfrom prefect.settings import get_current_settings as g\nprint(g().results.local_storage_path)"
    base = {k: v for k, v in os.environ.items() if k not in ("PREFECT_LOCAL_STORAGE_PATH", "PREFECT_RESULTS_LOCAL_STORAGE_PATH")}
    home = tmp_path / "home"

    def storage(**env: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                             env=base | {"PREFECT_HOME": str(home)} | env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert storage() == str(home / "storage")
    assert storage(PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert storage(PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(tmp_path / "ours")) == str(tmp_path / "ours")
    # every make target sees the same: the project's .prefect/storage by default
    show = ["make", "-s", "--no-print-directory", "--eval", "show-storage: ; @echo $$PREFECT_LOCAL_STORAGE_PATH", "show-storage"]
    for env, want in (({}, ROOT / ".prefect" / "storage"), ({"PREFECT_HOME": str(home)}, home / "storage"),
                      ({"PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "mine")}, tmp_path / "mine")):
        out = subprocess.run(show, capture_output=True, text=True, cwd=ROOT,
                             env={k: v for k, v in base.items() if k != "PREFECT_HOME"} | env)
        assert out.stdout.strip() == str(want), out.stderr
