"""State you can trust: a checkpoint knows its run and its step, its tensors' types are checked like their
shapes, a resume parses each manifest once, and the user's mistakes (a read-only output folder, several
unverifiable folders) get one message. Real managers, real files, single process."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from checkpoint_drills import Trainee, crc_entry, expect_error, manifest, train_and_save, unremovable, write_manifest
from vidstab.checkpoint import CheckpointConfig, CheckpointError, layout
from vidstab.run.run_dir import RUN_ID_FILE, RunDirNotWritable, claim_run_dir, run_id


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace ``folder/name`` by ``data`` and recompute its manifest entry (as a careful forger would)."""
    (folder / name).write_bytes(data)
    man = manifest(folder)
    man["files"][name] = crc_entry(data)
    write_manifest(folder, man)


def _retype(folder: Path, name: str, key: str, dtype: torch.dtype) -> None:
    """Cast tensor ``key`` of ``folder/name`` to ``dtype`` (same name and shape), manifest recomputed."""
    path = folder / name
    meta = safe_open(str(path), "pt").metadata()
    tensors = load_file(path)
    tensors[key] = tensors[key].to(dtype)
    tmp = folder / "retyped.tmp"
    save_file(tensors, tmp, metadata=meta)
    data = tmp.read_bytes()
    tmp.unlink()
    _rewrite(folder, name, data)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ run identity
def test_the_run_folder_gets_one_run_id_kept_on_resume_new_on_overwrite_and_adopted_when_lost(tmp_path):
    out = tmp_path / "run"
    with claim_run_dir(None, out) as lock:
        first = lock.run_id
    assert first and run_id(out, create=False) == first
    assert sorted(os.listdir(out)) == [".vidstab-run.json", ".vidstab.lock"]  # hidden, beside the lock
    with claim_run_dir(None, out) as lock:  # nothing written yet: not an earlier run, same id
        assert lock.run_id == first
    t = train_and_save(out, [2])
    man = manifest(t.folder(2))
    assert man["run_id"] == first and man["steps"] == {"trainer.json": {"step": 2}}
    with claim_run_dir(None, out, resume="latest") as lock:
        assert lock.run_id == first
    # The id file lost (checkpoints moved to new storage): the id the checkpoints carry is adopted.
    (out / RUN_ID_FILE).unlink()
    with claim_run_dir(None, out, resume="latest") as lock:
        assert lock.run_id == first
    with claim_run_dir(None, out, overwrite=True) as lock:
        assert lock.run_id != first and run_id(lock.moved_to, create=False) == first


def test_another_runs_checkpoint_is_refused_naming_both_runs_and_never_costs_the_run_its_own(tmp_path, caplog):
    other = train_and_save(tmp_path / "other", [12])
    theirs = manifest(other.folder(12))["run_id"]
    t = train_and_save(tmp_path / "run", [2, 4], config=CheckpointConfig(keep=2, async_save=False))
    ours = t.ckpt.run_id
    assert ours != theirs
    root = Path(t.ckpt.root)
    shutil.copytree(other.folder(12), root / "step_000012")  # a copied folder, newer step and sequence
    for ptr in ("latest", "last_good"):
        (root / ptr).unlink()
    state = Trainee(tmp_path / "run").ckpt.load("latest")  # never a candidate: the run's own newest loads
    assert state["step"] == 4 and not state["_checkpoint"]["skipped"]

    (root / "latest").write_text("step_000012\n")  # reached through the pointer: refused, both runs named
    expect_error(lambda: Trainee(tmp_path / "run").ckpt.load("latest"), "another run", theirs, ours,
                 "--allow_other_run_checkpoint", "allow_other_run=True")
    expect_error(lambda: t.ckpt.load(str(other.folder(12))), "another run", theirs, ours)  # named by its path
    # A symbolic link to the other run's folder, named by the pointer: refused, not followed.
    (root / "step_000020").symlink_to(other.folder(12), target_is_directory=True)
    (root / "latest").write_text("step_000020\n")
    expect_error(lambda: Trainee(tmp_path / "run").ckpt.load("latest"), "symbolic link", "never through a link")
    (root / "step_000020").unlink()
    (root / "latest").write_text("step_000004\n")

    # Rotation (keep=2) counts and deletes only the run's own: the copy stays, the run keeps its newest two.
    t.train(2)
    t.save()
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert names == ["step_000004", "step_000006", "step_000012"], names
    # The run saving the copy's step moves the copy aside, never replaces it.
    want = _files(root / "step_000012")
    t.train(6)
    t.save()
    assert _files(root / "other-run-step_000012") == want
    assert manifest(root / "step_000012")["run_id"] == ours

    # Asked for explicitly (fine-tuning from another run's weights): loaded, said, and saves stay this run's.
    fine = Trainee(tmp_path / "run", config=CheckpointConfig(keep=2, async_save=False, allow_other_run=True))
    with caplog.at_level(logging.WARNING, logger="vidstab.checkpoint"):
        state = fine.ckpt.load(str(other.folder(12)))
    assert state["step"] == 12 and "checkpoint of another run" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(fine.weights().values(), other.weights().values()))


def test_checkpoints_without_a_run_id_still_resume_with_one_warning(tmp_path, caplog):
    t = train_and_save(tmp_path / "run", [2, 4])
    for step in (2, 4):
        man = manifest(t.folder(step))
        del man["run_id"], man["steps"]
        write_manifest(t.folder(step), man)
    t2 = Trainee(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="vidstab.checkpoint"):
        assert t2.ckpt.load("latest")["step"] == 4
        assert t2.ckpt.load("step_000002")["step"] == 2
    assert caplog.text.count("before vidstab recorded run ids") == 1
    # Outside the run's checkpoint folder, a checkpoint without a run id cannot be told to be this run's.
    shutil.copytree(t.folder(2), tmp_path / "elsewhere" / "step_000002")
    expect_error(lambda: t2.ckpt.load(str(tmp_path / "elsewhere" / "step_000002")), "another run",
                 "records no run id", "--allow_other_run_checkpoint")


# ------------------------------------------------------------------------------------------ one step
def test_folder_name_manifest_and_trainer_json_must_agree_or_the_folder_is_unverifiable(tmp_path):
    t = train_and_save(tmp_path / "run", [2, 4, 6])
    # trainer.json says 7 in step_000006 (manifest entry recomputed): skipped, named, never replaced.
    _rewrite(t.folder(6), "trainer.json", b'{"step": 7}')
    # step_000004's manifest claims step 40 (it would sort as the newest): unverifiable too.
    man = manifest(t.folder(4))
    man["step"] = 40
    write_manifest(t.folder(4), man)
    root = Path(t.ckpt.root)
    # ... and renamed to match: its trainer.json still says 2.
    shutil.copytree(t.folder(2), root / "step_000040")
    man = manifest(root / "step_000040")
    man["step"] = 40
    write_manifest(root / "step_000040", man)
    (root / "latest").unlink()
    state = Trainee(tmp_path / "run").ckpt.load("latest")
    assert state["step"] == 2
    why = dict(layout.unverifiable(str(root)))
    assert "trainer.json says step 7, its manifest says step 6" in why["step_000006"]
    assert "folder name says step 4, its manifest says step 40" in why["step_000004"]
    assert "trainer.json says step 2, its manifest says step 40" in why["step_000040"]
    (root / "latest").write_text("step_000006\n")
    state = Trainee(tmp_path / "run").ckpt.load("latest")  # the pointer names it: tried, skipped, said why
    assert state["step"] == 2 and "trainer.json says step 7" in state["_checkpoint"]["skipped"][0][1]
    kept = _files(t.folder(6))
    t3 = Trainee(tmp_path / "run", config=CheckpointConfig(keep=1, async_save=False))
    t3.ckpt.load("latest")
    t3.step = 2
    for _ in range(3):
        t3.train(2)
        t3.save()  # steps 4, 6, 8 with keep=1: neither unverifiable folder is rotated away or replaced
    assert _files(root / "unverified-step_000006") == kept and (root / "unverified-step_000004").is_dir()
    assert manifest(root / "step_000008")["steps"] == {"trainer.json": {"step": 8}}


class StepCounter:
    """JSON state carrying a step, like the guard's ``step_count``."""

    def __init__(self, trainee: Trainee):
        self.trainee = trainee

    def state_dict(self):
        return {"step_count": self.trainee.step, "lr_multiplier": 1.0}

    def load_state_dict(self, d):
        self.loaded = d


def test_a_guard_state_from_another_step_makes_the_folder_unverifiable(tmp_path):
    t = Trainee(tmp_path / "run")
    t.ckpt.register("vidstab", StepCounter(t))
    for _ in range(2):
        t.train(2)
        t.save()
    assert manifest(t.folder(4))["steps"] == {"trainer.json": {"step": 4}, "vidstab.json": {"step_count": 4}}
    _rewrite(t.folder(4), "vidstab.json", b'{"step_count": 3, "lr_multiplier": 1.0}')
    t2 = Trainee(tmp_path / "run")
    t2.ckpt.register("vidstab", StepCounter(t2))
    state = t2.ckpt.load("latest")
    assert state["step"] == 2 and "vidstab.json says step_count 3" in state["_checkpoint"]["skipped"][0][1]


def test_several_unverifiable_folders_are_all_named_whichever_pointer(tmp_path):
    t = train_and_save(tmp_path / "run", [2, 4, 6])
    for step in (2, 4, 6):
        (t.folder(step) / "manifest.json").unlink()  # the pointers still name step_000006
    before = _files(Path(t.ckpt.root))
    for which in ("last_good", "latest"):
        expect_error(lambda: Trainee(tmp_path / "run").ckpt.load(which), "cannot be verified", "step_000002",
                     "step_000004", "step_000006", "nothing in them will be overwritten", "--overwrite_output_dir")
    assert _files(Path(t.ckpt.root)) == before


# ------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("file,key,dtype,needle", [
    ("model.safetensors", "0.weight", torch.float16, "model.0.weight is float16, the receiver holds float32"),
    ("optimizer.safetensors", None, torch.int32, "is int32, the receiver holds float32"),
    ("rng-rank0.safetensors", None, torch.int32, "rng-rank0.torch is int32, the receiver holds uint8"),
])
def test_a_tensor_of_the_right_shape_but_another_dtype_is_refused_naming_it(tmp_path, file, key, dtype, needle):
    t = train_and_save(tmp_path / "run", [2, 4])
    folder = t.folder(4)
    if key is None:  # the optimizer's first moment of the first parameter / the torch RNG state
        key = max(load_file(folder / file), key=lambda k: load_file(folder / file)[k].numel())
        if file.startswith("rng"):
            key = next(k for k, v in load_file(folder / file).items() if v.dtype == torch.uint8)
    _retype(folder, file, key, dtype)
    t2 = Trainee(tmp_path / "run")
    state = t2.ckpt.load("latest")
    assert state["step"] == 2, "the retyped checkpoint was loaded"
    (reason,) = [r for p, r in state["_checkpoint"]["skipped"] if p.endswith("step_000004")]
    assert needle in reason, reason


def test_an_intended_precision_change_is_cast_and_logged(tmp_path, caplog):
    t = train_and_save(tmp_path / "run", [2])
    _retype(t.folder(2), "model.safetensors", "0.weight", torch.float16)
    t2 = Trainee(tmp_path / "run", config=CheckpointConfig(async_save=False, cast_dtypes=True))
    with caplog.at_level(logging.WARNING, logger="vidstab.checkpoint"):
        assert t2.ckpt.load("latest")["step"] == 2
    assert "cast 1 tensor(s) of 'model'" in caplog.text and "0.weight float16->float32" in caplog.text
    assert t2.weights()["0.weight"].dtype == torch.float32
    assert torch.equal(t2.weights()["0.weight"], t.weights()["0.weight"].half().float())


# ------------------------------------------------------------------------------------------ bounded work
def test_a_resume_parses_each_manifest_once(tmp_path, monkeypatch):
    t = train_and_save(tmp_path / "run", [2, 4, 6])
    t2 = Trainee(tmp_path / "run")
    parsed: list[str] = []
    real = layout.loads_bounded

    def counting(data, what, **kw):
        if what == layout.MANIFEST:
            parsed.append(what)
        return real(data, what, **kw)

    monkeypatch.setattr(layout, "loads_bounded", counting)  # a spy: every call still parses for real
    assert t2.ckpt.load("latest")["step"] == 6
    assert len(parsed) == 3, f"{len(parsed)} manifest parses for 3 checkpoint folders"


# ------------------------------------------------------------------------------------------ read-only folder
def test_a_read_only_output_folder_is_one_line_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    with claim_run_dir(None, out):
        pass
    (out / ".vidstab.lock").unlink()
    before = _files(out)
    undo = unremovable(out)
    if undo is None:
        pytest.skip("cannot make a folder immutable here (needs root and chattr)")
    try:
        with pytest.raises(RunDirNotWritable) as e:
            claim_run_dir(None, out, resume="latest")
        with pytest.raises(RunDirNotWritable):
            claim_run_dir(None, out / "fresh")
    finally:
        undo()
    msg = str(e.value)
    assert "\n" not in msg and "cannot be written" in msg and "Nothing in it was changed" in msg, msg
    assert _files(out) == before


def test_the_trainer_says_one_line_for_a_read_only_output_folder(tmp_path):
    from trainer_utils import run_trainer

    out = tmp_path / "run"
    out.mkdir()
    undo = unremovable(out)
    if undo is None:
        pytest.skip("cannot make a folder immutable here (needs root and chattr)")
    try:
        done = run_trainer(out, "--max_train_steps", "2", "--resume_from_checkpoint", "latest", check=False)
    finally:
        undo()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    (line,) = [ln for ln in done.stderr.splitlines() if "error:" in ln]
    assert "cannot be written" in line and "choose another --output_dir" in line, line
    assert os.listdir(out) == []


def test_a_sharded_checkpoint_with_a_retyped_shard_is_refused_naming_the_tensor(tmp_path):
    t = train_and_save(tmp_path / "run", [2], config=CheckpointConfig(keep=2, async_save=False, sharded=True))
    folder = t.folder(2)
    (shard,) = [p for p in folder.rglob("*.safetensors") if p.parent.name == "dcp"]
    key = next(k for k in load_file(shard) if k.startswith("model.") and k.endswith("weight"))
    _retype(folder, str(shard.relative_to(folder)), key, torch.float16)
    t2 = Trainee(tmp_path / "run", config=CheckpointConfig(async_save=False, sharded=True))
    expect_error(lambda: t2.ckpt.load("latest"), key, "is float16", "the receiver holds float32")
