"""The full-rlhf and nightly flows under the real Prefect (a temporary server, results stored per test)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from checkpoints import read_manifest, verify
from tests.conftest import no_worker_processes

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def results(prefect_server, tmp_path):
    """Prefect's result storage in this test's folder (the harness isolates the database only)."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: str(tmp_path / "prefect-results")}):
        yield tmp_path


def write_pipeline(path: Path, task_files, root: Path, with_dpo: bool = False, with_sft: bool = True) -> Path:
    """base -> sft [-> dpo]; ``with_sft=False``: base -> dpo (a stage fewer where SFT is not what is tested)."""
    stages = [{"name": "base", "stage": "tiny_model", "overrides": {"preset": "micro"}}]
    if with_sft:
        stages.append({"name": "sft", "stage": "sft", "recipe": "recipes/sft/tiny.yaml", "inputs": {"base": "base"},
                       "overrides": {"data.paths": [str(task_files["sft"])], "train.max_steps": 1, "train.progress_bar": False}})
    if with_dpo:
        stages.append({"name": "dpo", "stage": "dpo", "recipe": "recipes/dpo/tiny.yaml", "inputs": {"policy": "sft" if with_sft else "base"},
                       "retries": 1, "retry_delay_seconds": 0,
                       "overrides": {"data.paths": [str(task_files["preference"])], "train.max_steps": 3,
                                     "train.progress_bar": False}})
    path.write_text(yaml.safe_dump({"name": "micro", "output_root": str(root), "stages": stages}))
    return path


def task_states(state) -> dict[str, tuple[str, int]]:
    """Task run name -> (state name, run count) for the flow run behind ``state``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return {r.name: (r.state.name, r.run_count) for r in runs}


def run_flow(**kwargs):
    from flows.full_rlhf import full_rlhf

    state = full_rlhf(**kwargs, return_state=True)
    return state, task_states(state)


def project_copy(root: Path, monkeypatch) -> Path:
    """Code versions read from a copy of the project's packages, which a test may edit (the code that runs
    is the real one: what is tested is what decides whether a stage reruns)."""
    import shutil

    from stages.common import identity

    for pkg in ("checkpoints", "datasets_prep", "flows", "stages"):
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(identity, "PROJECT_ROOT", root)  # where code_version reads the source files
    return root


def test_one_identity_decides_every_hit_and_miss_code_data_config_input_refresh_and_a_cli_run(results, task_files, monkeypatch):
    """The run identity decides everything, on base -> sft -> dpo: an unchanged recipe comes back Cached; an edit
    to a module DPO imports only through another reruns DPO alone; a dataset edited in place gives DPO a new run
    folder and leaves the old checkpoint as it was; an altered checkpoint fails verification and its stage
    reruns; refresh forces a stage; a config change of SFT reruns it, and DPO, whose own config is unchanged,
    on its new input; an SFT run from the CLI is found by the flow (same identity, same folder) instead of
    trained again."""
    import shutil

    from checkpoints import read_manifest

    code = project_copy(results / "project", monkeypatch)
    pairs = results / "pairs.jsonl"  # a data file the test edits in place
    shutil.copy(task_files["preference"], pairs)
    recipe = write_pipeline(results / "pipeline.yaml", {**task_files, "preference": pairs}, results / "runs", with_dpo=True)
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Completed", 1), "sft": ("Completed", 1), "dpo": ("Completed", 1)}
    first = state.result()
    assert verify(first["sft"]["path"]).digest == first["sft"]["digest"]

    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Cached", 1), "sft": ("Cached", 1), "dpo": ("Cached", 1)}
    assert state.result() == first

    # datasets_prep/preference.py: imported by the DPO stage (through datasets_prep and stages.common
    # modules too), never by SFT or the tiny-model factory
    with open(code / "datasets_prep" / "preference.py", "a") as f:
        f.write("\n# edited\n")
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Cached", 1), "sft": ("Cached", 1), "dpo": ("Completed", 1)}
    second = state.result()
    assert Path(second["dpo"]["path"]).parent != Path(first["dpo"]["path"]).parent

    # the preference data edited in place (its last pair dropped): a new folder; the old checkpoint stands
    lines = pairs.read_text().splitlines(keepends=True)
    pairs.write_text("".join(lines[:-1]))
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Cached", 1), "sft": ("Cached", 1), "dpo": ("Completed", 1)}
    third = state.result()
    assert Path(third["dpo"]["path"]).parent not in (Path(p["dpo"]["path"]).parent for p in (first, second))
    assert verify(second["dpo"]["path"]).digest == second["dpo"]["digest"]  # untouched
    assert verify(third["dpo"]["path"]).extra["data"]["rows"] == len(lines) - 1

    # the cached SFT checkpoint is altered (a deleted one fails the same verification): SFT reruns and its
    # output verifies again, the same weights as before (fp32)
    with open(Path(first["sft"]["path"]) / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks["base"] == ("Cached", 1) and tasks["sft"] == ("Completed", 1)
    assert verify(state.result()["sft"]["path"]).digest == first["sft"]["digest"]

    # refresh forces a stage to rerun
    _, tasks = run_flow(pipeline=str(recipe), refresh=["dpo"])
    assert tasks == {"base": ("Cached", 1), "sft": ("Cached", 1), "dpo": ("Completed", 1)}

    # SFT from its CLI with the flow's recipe, overrides and base; then the flow with those settings: SFT's
    # changed config misses the cache (found from the CLI's run), and DPO reruns on its new input
    shutil.rmtree(code)
    project_copy(code, monkeypatch)  # the code as it is (the CLI subprocess reads the real files)
    sft_cli = [f"base={first['base']['path']}", f"data.paths=[{task_files['sft']}]", "train.max_steps=2",
               "train.progress_bar=false", f"output_root={results / 'runs'}"]
    out = subprocess.run([sys.executable, "-m", "stages.sft", "recipes/sft/tiny.yaml", *sft_cli], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    cli_ref = json.loads(out.stdout[out.stdout.index("{"):])
    created = read_manifest(cli_ref["path"]).created
    state, tasks = run_flow(pipeline=str(recipe), overrides={"sft": {"train.max_steps": 2}})
    assert tasks == {"base": ("Cached", 1), "sft": ("Completed", 1), "dpo": ("Completed", 1)}
    assert state.result()["sft"]["digest"] == cli_ref["digest"] != first["sft"]["digest"]
    assert read_manifest(cli_ref["path"]).created == created  # not trained again: the CLI's checkpoint itself
    assert not (Path(cli_ref["path"]).parent / "task").exists()  # the flow launched no stage process for it


class _Boom:
    """Unpickling it creates ``marker`` (what a pickle dropped into the result storage could do: run code)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_results_are_json_and_a_pickle_placed_in_the_result_storage_is_never_unpickled(results, task_files):
    """Every cached stage result is stored as JSON; a pickle record put under a stage's key is ignored unread: the
    stage's committed checkpoint of the same identity is picked up instead (not trained again), and the code
    the pickle names never runs."""
    from prefect.results import get_result_store
    from prefect.serializers import PickleSerializer

    from flows.tasks import run_stage

    recipe = write_pipeline(results / "pipeline.yaml", task_files, results / "runs")
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Completed", 1), "sft": ("Completed", 1)}
    first = state.result()
    storage = results / "prefect-results"
    for record in storage.iterdir():  # task records name their serializer; the flow's summary is plain JSON
        data = json.loads(record.read_bytes())
        assert "metadata" not in data or data["metadata"]["serializer"]["type"] == "json", record
    key = Path(first["sft"]["path"]).parent.name  # the SFT task's cache key: its run's identity, the folder's name
    assert json.loads((storage / key).read_bytes())["metadata"]["serializer"]["type"] == "json"
    marker = results / "pwned"
    store = get_result_store().update_for_task(run_stage).model_copy(update={"serializer": PickleSerializer()})
    store.write(key=key, obj=_Boom(marker))
    assert json.loads((storage / key).read_bytes())["metadata"]["serializer"]["type"] == "pickle"
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Cached", 1), "sft": ("Completed", 1)}
    assert state.result()["sft"] == first["sft"]  # the committed checkpoint, found by identity
    assert read_manifest(first["sft"]["path"]).created == read_manifest(state.result()["sft"]["path"]).created
    assert not marker.exists()
    assert json.loads((storage / key).read_bytes())["metadata"]["serializer"]["type"] == "json"  # rewritten as JSON
    assert (storage / f"{key}.refused").is_file()  # the pickle, kept aside for whoever looks into it, never loaded


def test_a_second_output_root_gets_outputs_of_its_own_and_the_first_root_keeps_its_own(results, task_files):
    """Identities leave the output root out (the same computation), but a run's outputs are its root's: the same
    pipeline under a second root, with one result storage, trains there instead of being handed the first root's
    checkpoints (as when a pipeline moves to shared storage for a cluster: the other nodes could not read them);
    back under the first root, its committed checkpoints are picked up by identity, not trained again; then Cached."""
    from checkpoints import read_manifest

    a = write_pipeline(results / "a.yaml", task_files, results / "runs-a")
    b = write_pipeline(results / "b.yaml", task_files, results / "runs-b")
    state, tasks = run_flow(pipeline=str(a))
    assert tasks == {"base": ("Completed", 1), "sft": ("Completed", 1)}
    first = state.result()
    state, tasks = run_flow(pipeline=str(b))
    assert tasks == {"base": ("Completed", 1), "sft": ("Completed", 1)}
    moved = state.result()
    for name in ("base", "sft"):
        assert Path(moved[name]["path"]).resolve().is_relative_to((results / "runs-b").resolve()), moved[name]
        assert Path(moved[name]["path"]).parent.name == Path(first[name]["path"]).parent.name  # one identity
        assert moved[name]["digest"] == first[name]["digest"]  # the same computation, the same weights (fp32)
    created = {name: read_manifest(ref["path"]).created for name, ref in first.items()}
    state, tasks = run_flow(pipeline=str(a))
    assert tasks == {"base": ("Completed", 1), "sft": ("Completed", 1)}
    assert state.result() == first
    assert {name: read_manifest(ref["path"]).created for name, ref in first.items()} == created  # found, not retrained
    _, tasks = run_flow(pipeline=str(a))
    assert tasks == {"base": ("Cached", 1), "sft": ("Cached", 1)}


def test_a_passing_gate_names_the_result_and_a_failing_one_fails_the_run_keeping_the_checkpoints(results, task_files):
    """Gates on SFT's metrics: one that holds gives the run its result (the SFT checkpoint) in the summary; one that
    doesn't (the stages come back Cached: gates are not part of any identity) fails the flow run naming the gate,
    the value and the threshold, shows it in the run summary, and leaves every checkpoint as it was."""
    recipe = write_pipeline(results / "pipeline.yaml", task_files, results / "runs")
    data = yaml.safe_load(recipe.read_text())
    data["stages"][1]["gates"] = ["sft.loss <= 100"]
    recipe.write_text(yaml.safe_dump(data))
    state, tasks = run_flow(pipeline=str(recipe))
    assert state.is_completed() and tasks == {"base": ("Completed", 1), "sft": ("Completed", 1)}
    summary = state.result()
    assert summary["pipeline_result"] == {"stage": "sft", **summary["sft"]}
    loss = json.loads((Path(summary["sft"]["path"]).parent / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    assert "| `sft.loss <= 100` | sft |" in _summary_markdown(state) and "**Result**: stage `sft`" in _summary_markdown(state)

    data["stages"][1]["gates"] = ["sft.loss <= 0.001"]
    recipe.write_text(yaml.safe_dump(data))
    state, tasks = run_flow(pipeline=str(recipe))
    assert state.is_failed() and tasks == {"base": ("Cached", 1), "sft": ("Cached", 1)}
    with pytest.raises(Exception, match=rf"1 of 1 gate\(s\) failed: stage 'sft': sft.loss <= 0.001: sft.loss = {loss:.6g} "
                                        r"not <= 0.001 \(the checkpoints stand; the run has no result\)"):
        state.result()
    assert "**No result**: a gate failed" in _summary_markdown(state)
    assert verify(summary["sft"]["path"]).digest == summary["sft"]["digest"]


def _task_spans(state, names: list[str]) -> dict[str, tuple]:
    """Task run name -> (start, end) for the flow run behind ``state``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return {r.name: (r.start_time, r.end_time) for r in runs if r.name in names}


def _summary_markdown(state) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pipeline-summary"])),
                                     flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return arts[0].data


def test_a_sweep_runs_every_variant_a_failing_one_alone_fails_and_the_comparison_names_the_best(results, task_files):
    """Three RL variants (sweep.variants) from one SFT, each evaluated: base and SFT run once; max_concurrent 2 trains
    two variants at once, never three. The third variant's reward raises at its first step (not at planning's dry
    call, which scores two rows): only its branch fails (no eval-v2), the other variants' evals run, the comparison
    (an artifact and comparison.md/.png/.json under the output root) marks v2 failed and ranks the others by
    sweep.select, best first; the flow then fails naming rl-v2. The sweep without v2: every stage Cached, the run
    passes and its result is the best variant's RL checkpoint."""
    reward = results / "flaky_reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    if len(queries) > 2:\n"
                      "        raise RuntimeError('the grading service is down')\n    return [0.0] * len(queries)\n")
    recipe = write_pipeline(results / "pipeline.yaml", task_files, results / "runs")
    data = yaml.safe_load(recipe.read_text())
    data["stages"].append({"name": "rl", "stage": "rl", "recipe": "recipes/rl/tiny.yaml", "inputs": {"policy": "sft"}, "overrides": {
        "data.paths": [str(task_files["rl_prompts"])], "eval_data.paths": [str(task_files["eval"])], "eval_steps": 0,
        "rollout.rollout_batch_size": 8, "rollout.n_samples_per_prompt": 4, "rollout.max_new_tokens": 6,
        "train.train_batch_size": 16, "train.micro_train_batch_size": 16, "max_steps": 2, "train.progress_bar": False}})
    data["stages"].append({"name": "eval", "stage": "eval", "recipe": "recipes/eval/tiny.yaml", "inputs": {"models": ["sft", "rl"]},
                           "overrides": {"data.paths": [str(task_files["eval"])], "data.max_samples": 16, "num_samples": 0,
                                         "max_new_tokens": 6}})
    variants = [{"rl.algo.advantage_estimator": "group_norm"}, {"rl.algo.advantage_estimator": "rloo"},
                {"rl.algo.advantage_estimator": "rloo", "rl.reward.func": str(reward)}]
    data["sweep"] = {"variants": variants, "max_concurrent": 2, "select": {"metric": "eval.rl.response_length", "mode": "min"}}
    recipe.write_text(yaml.safe_dump(data))
    state, tasks = run_flow(pipeline=str(recipe))
    assert state.is_failed()
    assert tasks == {"base": ("Completed", 1), "sft": ("Completed", 1), "rl-v2": ("Failed", 1),
                     **{f"{s}-v{i}": ("Completed", 1) for i in range(2) for s in ("rl", "eval")}}
    with pytest.raises(Exception, match=r"stage\(s\) of the sweep failed \(rl-v2, eval-v2\); the other variants finished .*"
                                        r"rl-v2: stage 'rl-v2' \(rl\) failed: .*the grading service is down"):
        state.result()
    # max_concurrent 2: two stages trained at once, never three
    spans = _task_spans(state, ["rl-v0", "rl-v1", "rl-v2"])
    overlapping = [(a, b) for a in spans for b in spans if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]
    assert overlapping and len(overlapping) < 3, spans
    folder = results / "runs" / "sweep-micro"
    comp = json.loads((folder / "comparison.json").read_text())
    lengths = {r["variant"]: r["eval.rl.response_length"] for r in comp["rows"] if r["status"] == "ok"}
    best = min(lengths, key=lengths.get)
    assert comp["best"] == best and [r["variant"] for r in comp["rows"]][:2] == sorted(lengths, key=lengths.get)
    assert comp["rows"][2]["variant"] == "v2" and comp["rows"][2]["status"].startswith("failed (rl-v2: ")
    assert [r["selected"] for r in comp["rows"][:2]] == sorted(lengths.values())
    assert {r["label"] for r in comp["rows"]} == {"advantage_estimator=group_norm", "advantage_estimator=rloo",
                                                  f"advantage_estimator=rloo, func={reward}"}
    md = (folder / "comparison.md").read_text()
    assert f"**{next(r['label'] for r in comp['rows'] if r['best'])}** (best, {best})" in md and "![held-out curves](comparison.png)" in md
    assert (folder / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        (art,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-comparison"])))
    assert "(v2) | rl.algo.advantage_estimator=rloo, rl.reward.func=" in art.data and "failed (rl-v2" in art.data and "(best, " in art.data and "data:image/png;base64," in art.data

    data["sweep"]["variants"] = variants[:2]
    recipe.write_text(yaml.safe_dump(data))
    state, tasks = run_flow(pipeline=str(recipe))
    assert state.is_completed() and set(tasks.values()) == {("Cached", 1)} and len(tasks) == 6
    summary = state.result()
    assert summary["sweep"]["best"] == best and summary["pipeline_result"] == {"stage": f"rl-{best}", **summary[f"rl-{best}"]}


def test_failure_in_a_late_stage_then_rerun_runs_only_that_stage_and_the_ui_shows_curves_report_and_summary(results, task_files, monkeypatch):
    recipe = write_pipeline(results / "pipeline.yaml", task_files, results / "runs", with_dpo=True, with_sft=False)
    monkeypatch.setenv("RLHF_FAULT_STEP", "2")  # the trainer raises after step 2: only DPO gets there
    state, tasks = run_flow(pipeline=str(recipe))
    assert state.is_failed()
    assert tasks["base"] == ("Completed", 1)
    assert tasks["dpo"] == ("Failed", 2)  # its one retry from the recipe failed the same way
    # the flow's error is one line naming the stage and the cause (the stage's traceback is in its task's log)
    with pytest.raises(Exception, match=r"^stage 'dpo' \(dpo\) failed: RuntimeError: injected fault at step 2 on rank 0 \(its "
                                        r"traceback is in the log above and in .*/task/rank0.error\)$"):
        state.result()
    assert not no_worker_processes(results / "runs")

    monkeypatch.delenv("RLHF_FAULT_STEP")
    data = yaml.safe_load(recipe.read_text())  # with a held-out set now: its metrics reach the progress artifact
    data["stages"][1]["overrides"].update({"eval_data": {"paths": [str(task_files["preference_eval"])], "max_len": 64}, "eval_steps": 2})
    data["stages"].append({"name": "eval", "stage": "eval", "recipe": "recipes/eval/tiny.yaml", "inputs": {"models": ["base", "dpo"], "reference": "base"},
                           "overrides": {"data.paths": [str(task_files["eval"])], "data.max_samples": 16, "max_new_tokens": 6, "num_samples": 2, "pass_k": 2}})
    recipe.write_text(yaml.safe_dump(data))
    state, tasks = run_flow(pipeline=str(recipe))
    assert tasks == {"base": ("Cached", 1), "dpo": ("Completed", 1), "eval": ("Completed", 1)}
    out = state.result()
    dpo = out["dpo"]
    verify(dpo["path"])
    rows = [json.loads(ln) for ln in (Path(dpo["path"]).parent / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in rows if "eval_reward_accuracy" in r][-1]
    assert last_eval["step"] == rows[-1]["step"] == 3
    arts = flow_artifacts(state)
    (desc,) = [a.description for a in arts if a.type == "progress" and a.description.startswith("dpo (dpo)")]
    assert f"step 3/3, loss {rows[-1]['loss']:.4g}" in desc, desc
    assert f"eval at step 3: loss {last_eval['eval_loss']:.4g}" in desc and f"reward_accuracy {last_eval['eval_reward_accuracy']:.4g}" in desc, desc
    curves = assert_curves(arts, "dpo", rows)  # loss, implicit rewards, accuracy and margin, train and held-out
    assert {"loss", "eval_loss", "reward_accuracy", "eval_reward_accuracy", "reward_margin", "eval_reward_margin"} <= set(curves)
    assert not [a for a in arts if a.key in ("base-curves", "eval-curves")]  # no training log, no curves

    # the eval report with its plot inside (a data URI, no file to reach), and the flow's summary of every stage
    (report,) = [a for a in arts if a.key == "eval-report-eval"]
    assert_self_contained(report.data)
    assert "| base |" in report.data and "| dpo |" in report.data
    (summary,) = [a for a in arts if a.key == "pipeline-summary"]
    for name in ("base", "dpo"):  # the cached base too
        assert out[name]["digest"][:16] in summary.data and Path(out[name]["path"]).parent.resolve().as_uri() in summary.data
    for key in ("dpo-curves", "eval-report-eval"):  # links to this run's artifacts
        (art,) = [a for a in arts if a.key == key]
        assert f"[{key}](/artifacts/artifact/{art.id})" in summary.data
    assert Path(out["eval"]["report"]).parent.resolve().as_uri() in summary.data


def flow_artifacts(state) -> list:
    """Every artifact the flow run behind ``state`` (and its task runs) published, in creation order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))


def assert_self_contained(markdown: str) -> None:
    """The markdown's images are PNGs inside it (the UI needs no file and no other server)."""
    import base64
    import re

    uris = re.findall(r"!\[[^\]]*\]\(([^)]*)\)", markdown)
    assert uris and "file:" not in markdown.split("Files:")[0]
    for uri in uris:
        assert uri.startswith("data:image/png;base64,") and base64.b64decode(uri.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def assert_curves(arts, name: str, rows: list[dict]) -> dict[str, list]:
    """The stage's one curves artifact (updated in place, not one per update): self-contained, every plotted
    metric with at least two points, each equal to the stage's metrics.jsonl at its step (4 digits)."""
    from flows.curves import artifact_key, parse_table

    (art,) = [a for a in arts if a.key == artifact_key(name)]
    assert_self_contained(art.data)
    assert f"{len(rows)} logged steps, finished" in art.data
    table = parse_table(art.data)
    assert table and all(len(pts) >= 2 for pts in table.values()), {k: len(v) for k, v in table.items()}
    at = {r["step"]: r for r in rows}
    for key, pts in table.items():
        for step, value in pts:
            assert value == pytest.approx(at[step][key], rel=5e-4, abs=1e-12), (key, step)
    return table


def test_bad_pipeline_is_rejected_before_any_stage_runs(results, task_files):
    from stages.common.recipe import RecipeError

    recipe = write_pipeline(results / "pipeline.yaml", task_files, results / "runs", with_dpo=True)
    data = yaml.safe_load(recipe.read_text())
    data["stages"][2]["overrides"]["train.lr"] = "fast"
    recipe.write_text(yaml.safe_dump(data))
    state, tasks = run_flow(pipeline=str(recipe))
    assert state.is_failed() and tasks == {}
    with pytest.raises(RecipeError, match=r"(?s)stages\[2\] \(dpo\).*train\.lr: .*got .fast."):
        state.result()
    assert not (results / "runs").exists()
    # from the command line the recipe is checked before Prefect's temporary server is started
    env = {**os.environ, "PREFECT_HOME": str(results / "cli-prefect")}
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "flows.full_rlhf", str(recipe)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "train.lr" in out.stderr and "got 'fast'" in out.stderr, out.stderr[-2000:]
    assert "temporary server" not in (out.stdout + out.stderr).lower()
    assert not (results / "cli-prefect").exists() or not any((results / "cli-prefect").rglob("*.db"))


def api_post(api: str, path: str, body: dict) -> list | dict:
    import urllib.request

    req = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def deployment_run(env: dict, cwd: Path, *params: str) -> tuple[str, str]:
    """`prefect deployment run full-rlhf/tiny --watch --param ...` -> (flow run id, output)."""
    import re
    import time

    cmd = [sys.executable, "-m", "prefect", "deployment", "run", "full-rlhf/tiny", "--watch"]
    for p in params:
        cmd += ["--param", p]
    for _ in range(60):  # until serve has registered the deployments
        out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
        text = out.stdout + out.stderr
        if "not found" not in text.lower():
            break
        time.sleep(1)
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", text)
    assert found, text
    return found.group(1), text


def prefect_cli(env: dict, *args: str, timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


def test_work_pool_deployment_run_with_a_parameter_override_and_a_retry_from_the_cli(tmp_path, task_files):
    """prefect.yaml on a process work pool: a server on 127.0.0.1, `prefect deploy --all`, a worker
    (`prefect worker start`), `prefect deployment run` with a --param override; then a run that fails in its
    last stage, retried with `prefect flow-run retry` once the cause is fixed: the stage before comes back
    Cached. (`make serve` serves the same deployments: test_deployments checks they agree.)"""
    import shutil
    import time

    from flows.local_server import local_server, stop
    from stages.common.launcher import free_port

    recipe = write_pipeline(tmp_path / "pipeline.yaml", task_files, tmp_path / "runs", with_dpo=True, with_sft=False)
    # the DPO data is there but broken until after the first failure (a missing file would fail the plan before any
    # stage: what the stage reads is found wrong only by the stage)
    pairs = tmp_path / "later" / "pairs.jsonl"
    pairs.parent.mkdir()
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2"}
    env.pop("RLHF_FAULT_STEP", None)
    with local_server(free_port(), tmp_path / "server.log", env) as api:
        env["PREFECT_API_URL"] = api
        prefect_cli(env, "work-pool", "create", "rlhf-local", "--type", "process")
        deployed = prefect_cli(env, "--no-prompt", "deploy", "--all")
        assert "full-rlhf/tiny" in deployed and "nightly-recipe-validation/nightly" in deployed, deployed
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "rlhf-local"], env=env,
                                  cwd=tmp_path, start_new_session=True, stdout=open(tmp_path / "worker.log", "w"),
                                  stderr=subprocess.STDOUT)
        try:
            run_id, text = deployment_run(env, tmp_path, f"pipeline={recipe}",
                                          "overrides=" + json.dumps({"base": {"seed": 3}, "dpo": {"data.paths": [str(pairs)]}}))
            log = tmp_path / "worker.log"
            assert "Failed" in text, text + log.read_text()[-3000:]
            job = json.loads(next((tmp_path / "runs").glob("tiny_model-*/task/job.json")).read_text())
            assert job["config"]["seed"] == 3  # the override reached the stage

            def states() -> dict[str, list[str]]:
                out: dict[str, list[str]] = {}
                runs = api_post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC"})
                for r in runs:
                    out.setdefault(r["name"], []).append(r["state"]["name"])
                return out

            assert states() == {"base": ["Completed"], "dpo": ["Failed"]}
            assert "pairs.jsonl" in log.read_text()  # the stage's error names the file

            # a run's overrides can't choose code for a stage to run: refused by name before anything is planned
            evil = tmp_path / "evil.py"
            evil.write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\ndef reward_func(q, p, l):\n    return [0.0] * len(q)\n")
            _, text = deployment_run(env, tmp_path, f"pipeline={recipe}", "overrides=" + json.dumps({"rl": {"reward.func": str(evil)}}))
            assert "Failed" in text, text
            assert "overrides.rl.reward.func: names code for the stage to run (reward.func)" in log.read_text(), log.read_text()[-3000:]
            assert not (tmp_path / "pwned").exists()

            shutil.copy(task_files["preference"], pairs)
            prefect_cli(env, "flow-run", "retry", run_id)
            deadline = time.time() + 300
            while time.time() < deadline:
                state = api_post(api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})[0]["state"]["type"]
                if state in ("COMPLETED", "FAILED", "CRASHED"):
                    break
                time.sleep(2)
            assert state == "COMPLETED", log.read_text()[-3000:]
            after = states()
            assert after["base"][-1] == "Cached" and after["dpo"][-1] == "Completed", after
        finally:
            stop(worker)


def test_a_server_started_with_basic_auth_refuses_clients_without_it(tmp_path):
    """make serve / make server with PREFECT_SERVER_API_AUTH_STRING: every API call needs the credentials (Prefect's
    own middleware), the health check stays open, and a client with PREFECT_API_AUTH_STRING works."""
    import base64
    import urllib.error
    import urllib.request

    from flows.local_server import client_env, local_server
    from stages.common.launcher import free_port

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_API_AUTH_STRING": "team:s3cret"}
    env.pop("PREFECT_API_AUTH_STRING", None)
    with local_server(free_port(), tmp_path / "server.log", env) as api:
        def call(auth: str | None) -> int:
            req = urllib.request.Request(f"{api}/flows/filter", data=b"{}", headers={"Content-Type": "application/json"})
            if auth:
                req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert (call(None), call("team:wrong"), call("team:s3cret")) == (401, 401, 200)
        bare = {**env, "PREFECT_API_URL": api}
        out = subprocess.run([sys.executable, "-m", "prefect", "work-pool", "ls"], env=bare, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "401" in out.stdout + out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
        os.environ["PREFECT_SERVER_API_AUTH_STRING"] = "team:s3cret"  # what make serve's own clients get
        try:
            client = client_env(api)
        finally:
            del os.environ["PREFECT_SERVER_API_AUTH_STRING"]
        assert client["PREFECT_API_AUTH_STRING"] == "team:s3cret"
        out = subprocess.run([sys.executable, "-m", "prefect", "work-pool", "ls"], env={**bare, **client}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_stages_on_their_own_work_pools_and_a_rerun_after_a_failure_reruns_only_that_stage(tmp_path, task_files):
    """RL on work pool pool-rl, the other stages on pool-rest, a process worker on each: every stage runs as a flow
    run of run-stage/<its pool> on that pool's worker (read back from the API). RL fails first (a fault injected
    through its job variables); the flow run again, without the fault, reruns RL on its pool and base and SFT come
    back Cached."""
    from flows.local_server import local_server, stop
    from stages.common.launcher import free_port

    recipe = write_pipeline(tmp_path / "pipeline.yaml", task_files, tmp_path / "runs")
    data = yaml.safe_load(recipe.read_text())
    for st in data["stages"]:
        st["work_pool"] = "pool-rest"
    data["stages"].append({"name": "rl", "stage": "rl", "recipe": "recipes/rl/tiny.yaml", "inputs": {"policy": "sft"},
                           "work_pool": "pool-rl", "job_variables": {"env": {"RLHF_FAULT_STEP": "1"}}, "overrides": {
        "data.paths": [str(task_files["rl_prompts"])], "eval_data": None, "rollout.rollout_batch_size": 8,
        "rollout.n_samples_per_prompt": 4, "rollout.max_new_tokens": 6, "train.train_batch_size": 16,
        "train.micro_train_batch_size": 16, "max_steps": 2, "train.progress_bar": False}})
    recipe.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2"}
    env.pop("RLHF_FAULT_STEP", None)
    with local_server(free_port(), tmp_path / "server.log", env) as api:
        env["PREFECT_API_URL"] = api
        workers = []
        try:
            for pool in ("pool-rl", "pool-rest"):
                prefect_cli(env, "work-pool", "create", pool, "--type", "process")
                out = subprocess.run([sys.executable, "-m", "flows.stage_flow", "deploy", pool], env=env, cwd=ROOT,
                                     capture_output=True, text=True, timeout=300)
                assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
                workers.append(subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], env=env,
                                                cwd=tmp_path, start_new_session=True, stdout=open(tmp_path / f"{pool}.log", "w"),
                                                stderr=subprocess.STDOUT))

            def pipeline() -> subprocess.CompletedProcess:
                return subprocess.run([sys.executable, "-m", "flows.full_rlhf", str(recipe)], env=env, cwd=ROOT,
                                      capture_output=True, text=True, timeout=900)

            def stage_runs() -> list[tuple[str, str, str]]:
                runs = api_post(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["run-stage"]}}, "sort": "EXPECTED_START_TIME_ASC"})
                return [(r["parameters"]["name"], r["work_pool_name"], r["state"]["type"]) for r in runs]

            first = pipeline()
            assert first.returncode == 1 and "stage 'rl' (rl) failed on work pool 'pool-rl'" in first.stderr, first.stderr[-3000:]
            assert stage_runs() == [("base", "pool-rest", "COMPLETED"), ("sft", "pool-rest", "COMPLETED"), ("rl", "pool-rl", "FAILED")]
            assert "injected fault after RL step 1" in (tmp_path / "pool-rl.log").read_text()
            data["stages"][-1]["job_variables"] = {}  # the fault gone; job variables are not part of any identity
            recipe.write_text(yaml.safe_dump(data))
            second = pipeline()
            assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
            assert stage_runs()[3:] == [("rl", "pool-rl", "COMPLETED")]  # base and SFT: no new flow run (Cached)
            states = {r["name"]: r["state"]["name"] for r in api_post(api, "/task_runs/filter", {
                "task_runs": {"name": {"any_": ["base", "sft", "rl"]}}, "sort": "EXPECTED_START_TIME_DESC", "limit": 3})}
            assert states == {"base": "Cached", "sft": "Cached", "rl": "Completed"}, states
            verify(json.loads(second.stdout[second.stdout.index("{"):])["rl"]["path"])
        finally:
            for w in workers:
                stop(w)


def test_nightly_fails_on_a_drifted_trajectory(results, task_files):
    from flows.nightly import check, nightly_recipe_validation

    recipes = results / "recipes"
    (recipes / "sft").mkdir(parents=True)
    data = yaml.safe_load((ROOT / "recipes/sft/tiny.yaml").read_text())
    data["data"]["paths"] = [str(task_files["sft"])]
    data["validation"] = {"overrides": {"train.max_steps": 3}, "max": {"final.loss": 20.0}}
    (recipes / "sft" / "tiny.yaml").write_text(yaml.safe_dump(data))
    (recipes / "tiny_model").mkdir()
    (recipes / "tiny_model" / "micro.yaml").write_text("preset: micro\n")  # validated, not run
    out = str(results / "runs")

    rows = nightly_recipe_validation(str(recipes), out, pin=True)
    pinned = json.loads((recipes / "sft" / "tiny.trajectory.json").read_text())["trajectory"]
    assert len(pinned) == 3 and rows[0]["why"] == "pinned 3 steps"

    assert [(r["recipe"], r["result"]) for r in rows] == [("recipes/sft/tiny.yaml", "pass"), ("recipes/tiny_model/micro.yaml", "pass")]
    assert check(pinned, {"final.loss": 1.0}, pinned, {"max": {"final.loss": 20.0}}) == []

    # the reference drifts at step 2 (or, equally, today's run does): the rerun fails there, so its step 1
    # reproduced the pinned one (fp32) and the flow fails naming the recipe
    pinned[1] += 0.5
    (recipes / "sft" / "tiny.trajectory.json").write_text(json.dumps({"trajectory": pinned}))
    with pytest.raises(RuntimeError, match=r"1 of 2 recipes failed validation: recipes/sft/tiny.yaml: step 2: loss"):
        nightly_recipe_validation(str(recipes), out)


def test_killing_the_flow_process_leaves_no_stage_process(tmp_path, task_files):
    """The stage's subprocess (and its ranks) die with the flow process, even on SIGKILL."""
    import signal
    import time

    recipe = write_pipeline(tmp_path / "pipeline.yaml", task_files, tmp_path / "runs")
    data = yaml.safe_load(recipe.read_text())
    data["stages"][1]["overrides"]["train.max_steps"] = 10_000  # still training when the flow is killed
    recipe.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    # its own process group: after the test, what Prefect itself started there (the ephemeral server) goes too
    flow = subprocess.Popen([sys.executable, "-m", "flows.full_rlhf", str(recipe)], env=env, cwd=ROOT,
                            stdout=open(tmp_path / "flow.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not list((tmp_path / "runs").glob("sft-*/metrics.jsonl")):
            assert flow.poll() is None, (tmp_path / "flow.log").read_text()[-3000:]
            time.sleep(1)
        assert no_worker_processes(tmp_path / "runs"), "the SFT ranks should be running"
    finally:
        flow.send_signal(signal.SIGKILL)
        flow.wait()
    def in_flow_session() -> list[str]:  # what the flow started in its session: Prefect's temporary server, ...
        left = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getsid(p.info["pid"]) == flow.pid:
                    left.append(" ".join(p.info["cmdline"] or [])[:120])
        return left

    deadline = time.time() + 30
    while time.time() < deadline and (no_worker_processes(tmp_path / "runs") or in_flow_session()):
        time.sleep(0.5)
    try:
        assert not no_worker_processes(tmp_path / "runs")
        assert in_flow_session() == []  # the reaper ended Prefect's temporary server too
    finally:
        try:
            os.killpg(flow.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
