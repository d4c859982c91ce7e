import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (
    CheckpointError,
    commit,
    import_pretrained,
    load_ref,
    read_manifest,
    require_kind,
    staging,
    verify,
)
from checkpoints.store import MANIFEST, content_digest

ROOT = Path(__file__).resolve().parents[2]


def _save(dest: Path, tensors: dict[str, torch.Tensor], **kw):
    with staging(dest) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        return commit(tmp, dest, stage=kw.pop("stage", "test"), kind=kw.pop("kind", "full"), config_hash="c0ffee", **kw)


def test_round_trip_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g).bfloat16()}
    ref = _save(tmp_path / "ck", tensors)
    m = verify(ref)
    assert set(m.files) == {"model.safetensors", "config.json"}
    back = load_file(str(Path(ref.path) / "model.safetensors"))
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))
    assert load_ref(ref.path) == ref
    assert ref.digest == content_digest(m.files)
    # identical content gives the identical digest; a different tensor a different one
    assert _save(tmp_path / "ck2", tensors).digest == ref.digest
    assert _save(tmp_path / "ck3", {**tensors, "w": tensors["w"] + 1}).digest != ref.digest


@pytest.mark.parametrize("damage", ["alter", "truncate", "delete", "add", "manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    ref = _save(tmp_path / "ck", {"w": torch.ones(64)})
    target = Path(ref.path) / "model.safetensors"
    if damage == "alter":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
        expected = "model.safetensors: sha256 differs"
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
        expected = "model.safetensors: size"
    elif damage == "delete":
        target.unlink()
        expected = "model.safetensors: file listed in the manifest is missing"
    elif damage == "add":
        (Path(ref.path) / "extra.safetensors").write_bytes(b"x")
        expected = "extra.safetensors: file not in the manifest"
    else:
        (Path(ref.path) / MANIFEST).unlink()
        expected = "no manifest.json"
    with pytest.raises(CheckpointError, match=expected):
        verify(ref)


def test_ref_to_replaced_content_is_refused(tmp_path):
    ref = _save(tmp_path / "ck", {"w": torch.ones(4)})
    _save(tmp_path / "ck", {"w": torch.zeros(4)})  # same folder, new content
    with pytest.raises(CheckpointError, match="but the reference expects"):
        verify(ref)


def test_error_in_save_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with staging(tmp_path / "ck") as tmp:
            save_file({"w": torch.ones(3)}, str(tmp / "model.safetensors"))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_killed_save_leaves_no_complete_looking_folder(tmp_path):
    """SIGKILL a process in the middle of writing a large checkpoint: the final name never appears."""
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from safetensors.torch import save_file
        from checkpoints import commit, staging
        with staging(Path({str(tmp_path)!r}) / "ck") as tmp:
            for i in range(200):
                save_file({{"w": torch.randn(256, 256)}}, str(tmp / f"shard-{{i:03d}}.safetensors"))
                if i == 3:
                    print("writing", flush=True)
            commit(tmp, Path({str(tmp_path)!r}) / "ck", stage="t", kind="full", config_hash="x")
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "ck").exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ck.partial-")
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify(leftovers[0])


def test_the_next_stage_start_under_the_same_root_removes_dead_writers_saves_only(tmp_path):
    """Leftovers of killed saves in any run folder under the output root (their writers dead) are removed when any
    stage run starts there; a save still being written (its writer alive) is left alone."""
    from stages.common.identity import StageRun

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = [tmp_path / "sft-aaa" / f".checkpoint.partial-{dead}-0001", tmp_path / "dpo-bbb" / "state" / "x",
             tmp_path / "dpo-bbb" / f".checkpoint.partial-{dead}-0002"]
    live = tmp_path / "rl-ccc" / f".checkpoint.partial-{os.getpid()}-0003"
    for folder in [*stale, live]:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    with StageRun(stage="eval", key="eval-ddd", output_root=str(tmp_path), parts={}).claimed():
        pass
    assert not stale[0].exists() and not stale[2].exists()
    assert stale[1].exists() and live.exists()  # another run's own files; a save in progress


_REPLACE_SCRIPT = """
import os, shutil, signal, sys, json
sys.path.insert(0, {root!r})
from pathlib import Path
import torch
from safetensors.torch import save_file
import checkpoints.store as store
point, exchange = sys.argv[1], sys.argv[2] == "1"
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
real_rename, real_rmtree, real_exchange = os.rename, shutil.rmtree, store._exchange
if not exchange:  # a file system without RENAME_EXCHANGE: the two-rename path
    store._exchange = lambda a, b: False
renames = []
def rename(a, b):
    renames.append((a, b))
    if point == "after_move_aside" and ".old-" in str(b):
        real_rename(a, b); die()
    real_rename(a, b)
os.rename = rename
def exchange_then_die(a, b):
    ok = real_exchange(a, b)
    if point == "after_exchange":
        die()
    return ok
if exchange:
    store._exchange = exchange_then_die
def rmtree(p, *a, **k):
    if point == "before_cleanup":
        die()
    real_rmtree(p, *a, **k)
store.shutil.rmtree = rmtree
dest = Path({dest!r})
with store.staging(dest) as tmp:
    save_file({{"w": torch.full((4,), 2.0)}}, str(tmp / "model.safetensors"))
    if point == "before_commit":
        die()
    store.commit(tmp, dest, stage="new", kind="full", config_hash="x")
"""


@pytest.mark.parametrize("point, exchange", [
    ("before_commit", True), ("after_exchange", True), ("before_cleanup", True),  # renameat2(RENAME_EXCHANGE)
    ("after_move_aside", False), ("before_cleanup", False),  # a file system without it: two renames
])
def test_killed_replace_leaves_a_loadable_checkpoint(tmp_path, point, exchange):
    """SIGKILL at each step of replacing a checkpoint: the name holds the old or the new one, verified, and the
    next save under that name removes what the killed one left."""
    old = _save(tmp_path / "ck", {"w": torch.ones(4)}, stage="old")
    script = _REPLACE_SCRIPT.format(root=str(ROOT), dest=str(tmp_path / "ck"))
    proc = subprocess.run([sys.executable, "-c", script, point, "1" if exchange else "0"], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ref = load_ref(tmp_path / "ck")  # verifies every file (and puts a moved-aside folder back)
    w = load_file(str(Path(ref.path) / "model.safetensors"))["w"]
    expect_new = point in ("after_exchange", "before_cleanup")
    assert ref.stage == ("new" if expect_new else "old") and w.tolist() == ([2.0] * 4 if expect_new else [1.0] * 4)
    if not expect_new:
        assert ref == old
    _save(tmp_path / "ck", {"w": torch.zeros(4)}, stage="third")
    assert [p.name for p in tmp_path.iterdir()] == ["ck"] and load_ref(tmp_path / "ck").stage == "third"


def test_pickles_are_never_committed(tmp_path):
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickle-format file"):
        with staging(tmp_path / "ck") as tmp:
            torch.save({"w": torch.ones(2)}, tmp / "pytorch_model.bin")
            commit(tmp, tmp_path / "ck", stage="t", kind="full", config_hash="x")
    assert not (tmp_path / "ck").exists()


def test_a_manifest_that_lists_a_pickle_is_refused_on_load(tmp_path):
    """A self-consistent folder written by hand (pickle file, manifest and digest to match) still never loads."""
    ref = _save(tmp_path / "ck", {"w": torch.ones(2)})
    folder = Path(ref.path)
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    from checkpoints.store import sha256_file

    m = json.loads((folder / MANIFEST).read_text())
    m["files"]["pytorch_model.bin"] = sha256_file(folder / "pytorch_model.bin")
    m["sizes"]["pytorch_model.bin"] = (folder / "pytorch_model.bin").stat().st_size
    m["digest"] = content_digest(m["files"])
    (folder / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickle-format file in a checkpoint"):
        load_ref(folder)


def test_import_local_hf_folder_and_refuse_non_models(tmp_path, micro_model):
    plain = tmp_path / "plain"
    plain.mkdir()
    for p in Path(micro_model.path).iterdir():
        if p.name != MANIFEST:
            (plain / p.name).write_bytes(p.read_bytes())
    ref = import_pretrained(plain, tmp_path / "store")
    assert ref.stage == "import" and ref.kind == "full"
    assert ref.digest == micro_model.digest  # same files, same content digest
    assert import_pretrained(ref.path, tmp_path / "store") == ref  # a checkpoint folder is used as it is
    assert import_pretrained(plain, tmp_path / "store") == ref  # unchanged source: the same import
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**cfg, "edited": True}))  # the source edited in place
    again = import_pretrained(plain, tmp_path / "store")
    assert again.digest != ref.digest and again.path != ref.path and load_ref(ref.path) == ref
    with pytest.raises(CheckpointError, match="not a model folder \\(no config.json\\)"):
        import_pretrained(tmp_path / "store", tmp_path / "store2")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="found only pickle weights: pytorch_model.bin"):
        import_pretrained(pickled, tmp_path / "store")
    with pytest.raises(CheckpointError, match=r"^no-such-org/no-such-model: a hub model id whose revision 'main' can't be resolved"):
        import_pretrained("no-such-org/no-such-model", tmp_path / "store")
    with pytest.raises(CheckpointError, match=r"^\./no/such/folder: no such model folder \(looked for /"):
        import_pretrained("./no/such/folder", tmp_path / "store")


def test_a_hub_model_id_is_fetched_at_the_commit_it_resolves_to(tmp_path, monkeypatch, micro_model):
    """A hub-style local cache, offline (refs/<branch|tag> -> commit, snapshots/<commit>/ the files): ``org/name``
    is main's commit, ``org/name@v1`` a tag's, ``org/name@<sha>`` that commit; each import records the commit, and
    two revisions with different weights are two run identities of the stage that starts from them."""
    from stages import registry
    from stages.sft import SFTConfig

    repo = tmp_path / "hub" / "models--org--tiny"
    first, second = "1" * 40, "2" * 40
    for sha in (first, second):
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        for p in Path(micro_model.path).iterdir():
            if p.name != MANIFEST:
                (snap / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((repo / "snapshots" / second / "config.json").read_text())
    (repo / "snapshots" / second / "config.json").write_text(json.dumps({**cfg, "revised": 2}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    (repo / "refs" / "v1").write_text(second)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store = tmp_path / "store"

    main = import_pretrained("org/tiny", store)
    assert read_manifest(main.path).extra == {"origin": f"hub:org/tiny@{first}"}
    assert main.digest == micro_model.digest and Path(main.path).name.startswith("import-tiny-")
    tagged = import_pretrained("org/tiny@v1", store)
    assert read_manifest(tagged.path).extra == {"origin": f"hub:org/tiny@{second}"} and tagged.digest != main.digest
    assert import_pretrained(f"org/tiny@{first}", store) == main  # pinned to main's commit: the same import

    spec = registry.spec("sft")

    def identity(base: str) -> str:
        config = SFTConfig.model_validate({"base": base, "data": {"paths": ["d.jsonl"]}, "output_root": str(store)})
        return spec.identify(config, spec.resolve_inputs(config, {})).key

    assert identity("org/tiny") == identity(f"org/tiny@{first}") != identity("org/tiny@v1")
    (repo / "refs" / "main").write_text(second)  # main moves upstream: a new identity, never the stale cache hit
    assert identity("org/tiny") == identity("org/tiny@v1")
    with pytest.raises(CheckpointError, match=r"^org/tiny: a hub model id whose revision 'v9' can't be resolved to a commit: "
                                              r"offline \(HF_HUB_OFFLINE=1\) and not in the local Hugging Face cache .*"
                                              r"pin it as org/tiny@<commit sha>"):
        import_pretrained("org/tiny@v9", store)


def test_require_kind_names_the_mismatch(tmp_path):
    ref = _save(tmp_path / "rm", {"w": torch.ones(2)}, kind="reward", stage="reward_model")
    with pytest.raises(CheckpointError, match="a 'reward' checkpoint \\(from stage 'reward_model'\\) was given as the policy"):
        require_kind(ref, ("full",), "the policy")
    require_kind(ref, ("reward",), "the reward model")  # the right kind passes
