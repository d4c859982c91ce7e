"""A stage run's one identity: what changes it (config, inputs, data contents, code in the import closure)
and what does not (watching, resuming, where runs go); the run folder it names; file hashing."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from checkpoints import CheckpointError, CheckpointRef, remembered_hashes, sha256_file
from checkpoints.store import _REMEMBERED
from stages import registry
from stages.common.stage import PROJECT_ROOT, StageRun, code_version, import_closure
from stages.rl.config import RLConfig
from stages.sft import SFTConfig


def ref(digest: str) -> CheckpointRef:
    return CheckpointRef(path="/x", stage="sft", kind="full", config_hash="c", digest=digest)


def sft_config(tmp_path: Path, **train) -> SFTConfig:
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        data.write_text('{"input": "1+1", "output": "2"}\n')
    return SFTConfig.model_validate({"data": {"paths": [str(data)]}, "train": train, "output_root": str(tmp_path / "runs")})


def test_identity_follows_config_and_inputs_not_watching_resuming_or_where_runs_go(tmp_path):
    spec = registry.spec("sft")
    run = spec.identify(sft_config(tmp_path), {"base": ref("a")})
    assert run.key.startswith("sft-") and run.run_dir == tmp_path / "runs" / run.key
    same = [sft_config(tmp_path, progress_bar=False, logging_steps=5, resume=True),
            sft_config(tmp_path).model_copy(update={"output_root": str(tmp_path / "elsewhere"), "base": "tiny:micro"})]
    assert all(spec.identify(c, {"base": ref("a")}).key == run.key for c in same)
    assert spec.identify(sft_config(tmp_path, lr=2.0), {"base": ref("a")}).key != run.key
    assert spec.identify(sft_config(tmp_path), {"base": ref("b")}).key != run.key
    # a flow hands the stage the identity it computed; one of another config is refused
    assert spec.identify(sft_config(tmp_path), {"base": ref("a")}, run) is run
    with pytest.raises(ValueError, match="computed for another config or other inputs"):
        spec.identify(sft_config(tmp_path, lr=2.0), {"base": ref("a")}, run)
    with pytest.raises(ValueError, match=r"no inputs named \['policy'\]"):
        spec.identify(sft_config(tmp_path), {"policy": ref("a")})


def test_identity_follows_the_contents_of_every_file_the_config_names(tmp_path):
    data, reward = tmp_path / "train.jsonl", tmp_path / "reward.py"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    reward.write_text("def reward_func(q, p, l): ...\n")
    cfg = RLConfig.model_validate({"data": {"paths": [str(data)]}, "reward": {"func": str(reward)}})
    spec = registry.spec("rl")
    key = spec.identify(cfg, {"policy": ref("a")}).key
    assert spec.identify(cfg, {"policy": ref("a")}).key == key
    data.write_text('{"prompt": "1+1", "label": "3"}\n')  # same path, edited rows
    edited = spec.identify(cfg, {"policy": ref("a")}).key
    assert edited != key
    reward.write_text("def reward_func(q, p, l): return {}\n")
    assert spec.identify(cfg, {"policy": ref("a")}).key not in (key, edited)
    folder = tmp_path / "hf_dataset"  # a saved dataset folder: every file counts
    folder.mkdir()
    (folder / "part-0.arrow").write_bytes(b"\x00\x01")
    sft = SFTConfig.model_validate({"data": {"paths": [str(folder)]}})
    before = registry.spec("sft").identify(sft, {"base": ref("a")})
    (folder / "part-0.arrow").write_bytes(b"\x00\x02")
    assert registry.spec("sft").identify(sft, {"base": ref("a")}).key != before.key
    assert list(before.parts["files"]) == [str(folder)]


def test_code_version_is_the_import_closure_and_an_edit_reruns_exactly_the_stages_that_import_it(tmp_path):
    files = {f.relative_to(PROJECT_ROOT).as_posix() for f in import_closure("stages.rl.driver")}
    # imported only inside a function, two modules down (stages.rl.driver -> stages.rl.actors.start_actors)
    assert "stages/common/scoring.py" in files and "stages/rl/learner.py" in files and "stages/common/worker.py" in files
    assert "stages/dpo.py" not in files  # stages never import each other (DPO's and RL's reference: stages.common)
    assert "stages/dpo.py" not in {f.relative_to(PROJECT_ROOT).as_posix() for f in import_closure("stages.sft")}
    assert not any(f.startswith(("flows/", "tests/", "bench/")) for f in files)

    copy = tmp_path / "project"  # the project's packages, to edit freely
    for pkg in ("checkpoints", "datasets_prep", "flows", "stages"):
        shutil.copytree(PROJECT_ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    specs = {name: registry.spec(name) for name in registry.STAGES}

    def versions() -> dict[str, str]:
        return {name: code_version(s.modules, copy) for name, s in specs.items()}

    before = versions()
    assert before == {name: code_version(s.modules) for name, s in specs.items()}  # same files, same versions
    with open(copy / "stages/dpo.py", "a") as f:
        f.write("\n# edited\n")
    after = versions()
    assert {n for n in specs if after[n] != before[n]} == {"dpo"}
    with open(copy / "datasets_prep/preference.py", "a") as f:
        f.write("\n# edited\n")
    assert {n for n, v in versions().items() if v != after[n]} == {"reward_model", "dpo"}
    with open(copy / "checkpoints/store.py", "a") as f:  # shared by every stage
        f.write("\n# edited\n")
    assert all(v != after[n] for n, v in versions().items())


def test_a_run_folder_holds_one_identity(tmp_path):
    run = StageRun(stage="sft", key="sft-aaaa", output_root=str(tmp_path), parts={})
    assert run.prepare() == tmp_path / "sft-aaaa"
    assert run.prepare() == tmp_path / "sft-aaaa"  # the same identity again: fine
    (tmp_path / "sft-bbbb").mkdir()
    shutil.copy(tmp_path / "sft-aaaa" / "identity.json", tmp_path / "sft-bbbb" / "identity.json")  # a copied folder
    with pytest.raises(CheckpointError, match=r"sft-bbbb: holds a run of identity 'sft-aaaa', not 'sft-bbbb'"):
        StageRun(stage="sft", key="sft-bbbb", output_root=str(tmp_path), parts={}).prepare()


def test_file_hashes_are_remembered_within_a_run_only_for_files_that_settled(tmp_path):
    fresh, old = tmp_path / "fresh.jsonl", tmp_path / "old.jsonl"
    fresh.write_text("a\n")
    old.write_text("b\n")
    past = time.time_ns() - 10_000_000_000
    os.utime(old, ns=(past, past))
    assert sha256_file(old) == hashlib.sha256(b"b\n").hexdigest()  # outside a run: nothing remembered
    with remembered_hashes():
        assert sha256_file(fresh) == hashlib.sha256(b"a\n").hexdigest()
        assert sha256_file(old) == hashlib.sha256(b"b\n").hexdigest()
        remembered = {k[0] for k in _REMEMBERED.get()}
        assert str(old.resolve()) in remembered and str(fresh.resolve()) not in remembered
        fresh.write_text("c\n")  # same size, same tick: still read again
        assert sha256_file(fresh) == hashlib.sha256(b"c\n").hexdigest()
        old.write_text("d\n")  # edited: its times change, the remembered hash no longer applies
        assert sha256_file(old) == hashlib.sha256(b"d\n").hexdigest()
        os.utime(old, ns=(past, past))
        with open(old, "rb") as f:  # read once more now, then answered from memory
            expected = hashlib.file_digest(f, "sha256").hexdigest()
        assert sha256_file(old) == expected
    assert _REMEMBERED.get() is None


def test_an_input_the_config_does_not_use_is_not_part_of_the_identity(tmp_path):
    """The default pipeline wires the reward model to RL as the critic's start: only PPO (gae) uses it."""
    spec = registry.spec("rl")
    grpo = RLConfig.model_validate({"data": {"paths": ["x.jsonl"]}, "reward": {"func": "r.py"}})
    ppo = grpo.model_copy(update={"algo": grpo.algo.model_copy(update={"advantage_estimator": "gae"})})
    assert spec.identify(grpo, {"policy": ref("a"), "critic": ref("rm")}).key == spec.identify(grpo, {"policy": ref("a")}).key
    assert spec.resolve_inputs(grpo, {"policy": ref("a"), "critic": ref("rm")})["critic"] is None
    assert spec.identify(ppo, {"policy": ref("a"), "critic": ref("rm")}).key != spec.identify(ppo, {"policy": ref("a")}).key


def test_a_hub_dataset_id_enters_the_identity_as_the_commit_it_resolves_to(tmp_path, monkeypatch, micro_model):
    """Offline, from a hub-style local cache (refs/<branch> -> commit): the dataset moving upstream (a new commit on
    main) is a new identity; data.revision pins a commit (or names a branch or tag); nothing cached: a DataError
    naming the id."""
    from datasets_prep.loading import DataError
    from stages import registry
    from stages.sft import SFTConfig

    refs = tmp_path / "hub" / "datasets--org--toy" / "refs"
    refs.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = registry.spec("sft")

    def identity(**data):
        cfg = SFTConfig.model_validate({"data": {"paths": ["org/toy"], **data}, "output_root": str(tmp_path / "runs")})
        return spec.file_digests(cfg), spec.identify(cfg, {"base": micro_model}).key

    (refs / "main").write_text("a" * 40 + "\n")
    files_a, key_a = identity()
    (refs / "main").write_text("b" * 40)
    files_b, key_b = identity()
    assert files_a == {"org/toy": "hub:" + "a" * 40} and files_b == {"org/toy": "hub:" + "b" * 40}
    assert key_a != key_b
    assert identity(revision="a" * 40)[1] == key_a  # pinned: the same identity as when main was there
    (refs / "v1").write_text("c" * 40)
    assert identity(revision="v1")[0] == {"org/toy": "hub:" + "c" * 40}
    with pytest.raises(DataError, match=r"^org/other: a hub dataset id whose revision 'main' can't be resolved to a commit: "
                                        r"offline \(HF_HUB_OFFLINE=1\) and not in the local Hugging Face cache"):
        spec.file_digests(SFTConfig.model_validate({"data": {"paths": ["org/other"]}}))


def test_a_plugin_file_s_identity_covers_the_helper_modules_it_imports_from_its_folder_tree(tmp_path):
    from stages.common.identity import plugin_files
    from stages.rl.rewards import FuncReward

    rewards = tmp_path / "rewards"
    (rewards / "shared").mkdir(parents=True)
    (rewards / "shared" / "__init__.py").write_text("")
    (rewards / "shared" / "parse.py").write_text("def answer(text):\n    return text.split()[-1]\n")
    (rewards / "helper.py").write_text("from shared.parse import answer\n\nBONUS = 1.0\n")
    (rewards / "unused.py").write_text("X = 1\n")
    func = rewards / "reward.py"
    # one helper at the top, one inside the function (imports inside functions count, as for the stage's code)
    func.write_text("import json\nimport torch\nimport helper\n\n\ndef reward_func(q, p, l):\n    from shared import parse\n"
                    "    return [helper.BONUS * (parse.answer(x) == y) for x, y in zip(q, l)]\n")
    assert {f.relative_to(rewards).as_posix() for f in plugin_files(func)} == {
        "reward.py", "helper.py", "shared/__init__.py", "shared/parse.py"}
    spec = registry.spec("rl")
    for i, ref_form in enumerate((str(func), f"{func}:reward_func")):
        cfg = RLConfig.model_validate({"data": {"paths": ["data/none.jsonl"]}, "reward": {"func": ref_form}})
        before = spec.identify(cfg, {"policy": ref("a")}).key
        (rewards / "shared" / "parse.py").write_text(f"def answer(text):\n    return text.split()[{i}]\n")  # a helper's helper
        edited = spec.identify(cfg, {"policy": ref("a")}).key
        (rewards / "helper.py").write_text(f"from shared.parse import answer\n\nBONUS = {2.0 + i}\n")
        again = spec.identify(cfg, {"policy": ref("a")}).key
        assert len({before, edited, again}) == 3
        (rewards / "unused.py").write_text(f"X = {i + 2}\n")  # a file it does not import is not part of it
        assert spec.identify(cfg, {"policy": ref("a")}).key == again
    # and the file runs as written: its folder is where `import helper` looks (BONUS 3.0; parse.answer: the 2nd word)
    assert FuncReward(str(func))(["a 1", "b c"], ["", ""], ["1", "b"])["rewards"].tolist() == [3.0, 0.0]


def test_a_run_s_record_is_written_beside_a_committed_one_and_replaces_it_at_commit(tmp_path):
    from stages.common.identity import commit_record, metrics_file, record_dir

    run_dir = tmp_path / "sft-x"
    run_dir.mkdir()
    assert record_dir(run_dir) == run_dir and metrics_file(run_dir) == run_dir / "metrics.jsonl"  # a first run: in place
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.old").write_text("old")
    (run_dir / "checkpoint").mkdir()  # committed: its record stays as it is
    assert metrics_file(run_dir) == run_dir / "metrics.jsonl"  # what the first run wrote, once it committed
    pending = record_dir(run_dir)
    assert pending == run_dir / ".record.pending"
    pending.mkdir()
    (pending / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (pending / "tensorboard").mkdir()
    (pending / "tensorboard" / "events.new").write_text("new")
    assert metrics_file(run_dir) == pending / "metrics.jsonl" and (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    commit_record(run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n' and not pending.exists()
    assert [p.name for p in (run_dir / "tensorboard").iterdir()] == ["events.new"]
    assert metrics_file(run_dir) == run_dir / "metrics.jsonl"
