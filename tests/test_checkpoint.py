"""CheckpointManager with real Accelerate, real files: round trip, validation, fallback, rotation, resume."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from vidstab.files import statedict_io as sio
from vidstab.run.run_dir import RUN_ID_FILE
from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager, verify_checkpoint_files
from trainer_utils import torchrun_cmd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import ckpt_train  # noqa: E402


class TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # tied: shared storage in the state dict

    def forward(self, idx):
        return self.out(torch.relu(self.mid(self.emb(idx))))


class GuardStandIn:
    """JSON-only state like the vidstab guard's."""

    def __init__(self):
        self.state = {"lr_multiplier": 1.0, "skipped": 0, "ema": {"grad_norm": float("nan")}, "window": (1, 2)}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, d):
        self.state = dict(d)


def _setup(tmp_path, config=None, steps=3):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TiedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    for _ in range(steps):
        loss = model(torch.randint(0, 10, (4,))).square().mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    ckpt = CheckpointManager(acc, str(tmp_path), config or CheckpointConfig(keep=3, async_save=False), config_hash="abc")
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    ckpt.register("lr_scheduler", sched)
    return acc, model, opt, sched, ckpt


def _perturb(model, opt, sched):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loss = model(torch.randint(0, 10, (4,))).square().mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_statedict_codec_keeps_python_shapes():
    obj = {"state": {0: {"step": torch.tensor(3.0), "buf": torch.arange(4)}},
           "param_groups": [{"betas": (0.9, 0.999), "params": [0, 1], "lr": 1e-3, "fused": None, "eps": float("inf")}],
           "__weird": [1, 2.5, "x", True, float("nan")], (1, 2): "tuple key", "dtype": torch.bfloat16}
    tensors, structure = sio.flatten(obj)
    back = sio.unflatten(sio.loads(sio.dumps(structure)), tensors)
    assert back["state"][0]["step"] is tensors["0"] and list(back["state"]) == [0]
    assert back["param_groups"][0]["betas"] == (0.9, 0.999) and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["param_groups"][0]["params"] == [0, 1] and isinstance(back["param_groups"][0]["params"][0], int)
    assert back["param_groups"][0]["eps"] == math.inf and back["param_groups"][0]["fused"] is None
    assert math.isnan(back["__weird"][4]) and back["__weird"][:4] == [1, 2.5, "x", True]
    assert back[(1, 2)] == "tuple key" and back["dtype"] is torch.bfloat16
    with pytest.raises(TypeError, match="without pickling"):
        sio.flatten({"f": object()})


def test_streaming_safetensors_writer_matches_the_reference_reader(tmp_path):
    from safetensors.torch import load_file

    base = torch.randn(3, 5)
    tensors = {"bf16": torch.randn(4, 3).to(torch.bfloat16), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "transposed": base.t(), "shared_a": base, "shared_b": base, "ints": torch.arange(7, dtype=torch.int64),
               "u32": torch.arange(5, dtype=torch.int64).to(torch.uint32), "flag": torch.tensor([True, False])}
    d = sio.write_safetensors(str(tmp_path / "x.safetensors"), tensors, {"format": "pt"})
    data = (tmp_path / "x.safetensors").read_bytes()
    assert d.bytes == len(data) and d.checksum == "crc32" and d.digest == f"0x{zlib.crc32(data):08x}"
    assert d.to_json() == {"bytes": len(data), "crc32": d.digest}
    d2 = sio.write_safetensors(str(tmp_path / "y.safetensors"), tensors, {"format": "pt"}, checksum="sha256")
    assert (tmp_path / "y.safetensors").read_bytes() == data
    assert d2.to_json() == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(ValueError, match="unknown checksum"):
        sio.write_safetensors(str(tmp_path / "z.safetensors"), tensors, checksum="md5")
    assert not (tmp_path / "z.safetensors").exists()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())


def test_writer_with_early_writeback_writes_the_same_bytes(tmp_path):
    from safetensors.torch import load_file

    tensors = {f"w{i}": torch.randn(1024, 1024) for i in range(6)}  # 24 MiB: crosses the 16 MiB writeback step
    a = sio.write_safetensors(str(tmp_path / "a.safetensors"), tensors, writeback=True)
    b = sio.write_safetensors(str(tmp_path / "b.safetensors"), tensors, fsync=False)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert data == (tmp_path / "b.safetensors").read_bytes() and a == b and a.bytes == len(data)
    assert a.digest == f"0x{zlib.crc32(data):08x}"
    back = load_file(str(tmp_path / "a.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_round_trip_restores_everything_without_pickle(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    guard = GuardStandIn()
    ckpt.register("vidstab", guard)
    want_w, want_sched = _weights(model), sched.state_dict()
    want_opt = opt.state_dict()
    want_opt = {"param_groups": want_opt["param_groups"],
                "state": {i: {k: v.clone() for k, v in s.items()} for i, s in want_opt["state"].items()}}
    torch.manual_seed(123)
    path = ckpt.save(3, healthy=True, trainer_state={"step": 3, "epoch": 0, "batch_in_epoch": 3})
    rng_after_save = torch.rand(4)

    _perturb(model, opt, sched)
    guard.state = {}
    state = ckpt.load("latest")

    assert state["step"] == 3 and state["_checkpoint"]["path"] == "vidstab/checkpoints/step_000003"
    got = _weights(model)
    assert all(torch.equal(got[k], v) for k, v in want_w.items())
    assert model.out.weight.data_ptr() == model.emb.weight.data_ptr()  # still tied after the load
    got_opt = opt.state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"]
    for i, s in want_opt["state"].items():
        assert all(torch.equal(got_opt["state"][i][k], v) for k, v in s.items())
    assert sched.state_dict() == want_sched
    assert guard.state["window"] == (1, 2) and math.isnan(guard.state["ema"]["grad_norm"])
    assert torch.equal(torch.rand(4), rng_after_save)  # RNG restored to the moment of the save

    names = set(os.listdir(path))
    assert {"manifest.json", "model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
            "vidstab.json", "trainer.json", "rng-rank0.safetensors", "rng-rank0.json"} <= names
    assert not [n for n in names if n.endswith((".pt", ".bin", ".pkl", ".pickle"))]
    man = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert man["step"] == 3 and man["healthy"] and man["params_finite"] and man["config_hash"] == "abc"
    assert man["world_size"] == 1 and set(man["files"]) == names - {"manifest.json"}
    assert open(tmp_path / "vidstab" / "checkpoints" / "latest").read().strip() == "step_000003"
    assert open(tmp_path / "vidstab" / "checkpoints" / "last_good").read().strip() == "step_000003"


def test_async_save_snapshots_state_at_call_time(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path, CheckpointConfig(async_save=True))
    want = _weights(model)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    _perturb(model, opt, sched)  # the loop goes on while the writer runs
    assert ckpt.wait() == str(tmp_path / "vidstab" / "checkpoints" / "step_000003")
    ckpt.load("latest")
    got = _weights(model)
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_fresh_run_has_nothing_to_load(tmp_path):
    *_, ckpt = _setup(tmp_path)
    assert ckpt.load("latest") is None and ckpt.latest_valid() is None and ckpt.list() == []


def test_rotation_keeps_newest_k_plus_last_good_and_health_gate(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path, CheckpointConfig(keep=2, async_save=False))
    ckpt.save(1, healthy=True, trainer_state={"step": 1})
    for s in (2, 3, 4):
        ckpt.save(s, healthy=False, trainer_state={"step": s})
    with torch.no_grad():
        model.mid.weight[0, 0] = float("nan")  # healthy=True is not enough: parameters must be finite
    ckpt.save(5, healthy=True, trainer_state={"step": 5})
    root = tmp_path / "vidstab" / "checkpoints"
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000001", "step_000004", "step_000005"]
    assert open(root / "last_good").read().strip() == "step_000001"
    assert open(root / "latest").read().strip() == "step_000005"
    man = json.loads((root / "step_000005" / "manifest.json").read_text())
    assert man["healthy"] is False and man["params_finite"] is False and man["healthy_requested"] is True
    assert ckpt.last_good() == str(root / "step_000001")
    assert ckpt.load("last_good")["step"] == 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete", "no_manifest"])
def test_damaged_checkpoint_falls_back_with_a_message(tmp_path, damage, caplog):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    want = _weights(model)
    _perturb(model, opt, sched)
    ckpt.save(4, healthy=True, trainer_state={"step": 4})
    bad = tmp_path / "vidstab" / "checkpoints" / "step_000004"
    f = bad / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-7])
    elif damage == "bitflip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))
    elif damage == "delete":
        (bad / "optimizer.safetensors").unlink()
    else:
        (bad / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="vidstab.checkpoint"):
        state = ckpt.load("latest")
    assert state["step"] == 3
    assert ckpt.latest_valid() == str(tmp_path / "vidstab" / "checkpoints" / "step_000003")
    if damage != "no_manifest":  # without a manifest it is not a checkpoint at all, nothing to report
        assert state["_checkpoint"]["skipped"][0][0] == "vidstab/checkpoints/step_000004"
        reason = {"truncate": "truncated", "bitflip": "crc32 mismatch", "delete": "missing"}[damage]
        assert reason in state["_checkpoint"]["skipped"][0][1]
        assert "step_000004" in caplog.text
    got = _weights(model)
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_no_valid_checkpoint_raises_and_loads_nothing(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    f = tmp_path / "vidstab" / "checkpoints" / "step_000003" / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[:-1])  # model file intact, optimizer broken: nothing may be loaded
    _perturb(model, opt, sched)
    before = _weights(model)
    with pytest.raises(CheckpointError, match="step_000003.*optimizer.safetensors"):
        ckpt.load("latest")
    got = _weights(model)
    assert all(torch.equal(got[k], v) for k, v in before.items())


def _flip_bit(path, bit=3):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_crc32_default_detects_a_single_bit_flip_and_verify_names_the_file(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    path = ckpt.save(3, healthy=True, trainer_state={"step": 3})
    man = json.loads((tmp_path / "vidstab" / "checkpoints" / "step_000003" / "manifest.json").read_text())
    for f, meta in man["files"].items():
        data = (tmp_path / "vidstab" / "checkpoints" / "step_000003" / f).read_bytes()
        assert meta == {"bytes": len(data), "crc32": f"0x{zlib.crc32(data):08x}"}, f
    verify_checkpoint_files(path)
    verify_checkpoint_files(path, ["model.safetensors"])
    with pytest.raises(CheckpointError, match=r"step_000003: file nope\.json is not listed"):
        verify_checkpoint_files(path, ["nope.json"])

    _flip_bit(tmp_path / "vidstab" / "checkpoints" / "step_000003" / "optimizer.safetensors")
    with pytest.raises(CheckpointError, match=r"step_000003: file optimizer\.safetensors is corrupt \(crc32 mismatch\)"):
        verify_checkpoint_files(path)
    verify_checkpoint_files(path, ["model.safetensors", "trainer.json"])  # the others are intact
    assert ckpt.latest_valid() is None
    with pytest.raises(CheckpointError, match="optimizer.safetensors is corrupt"):
        ckpt.load("latest")

    (tmp_path / "vidstab" / "checkpoints" / "step_000003" / "trainer.json").unlink()
    with pytest.raises(CheckpointError, match=r"file trainer\.json is missing"):
        verify_checkpoint_files(path, ["trainer.json"])
    f = tmp_path / "vidstab" / "checkpoints" / "step_000003" / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"x")
    with pytest.raises(CheckpointError, match=r"file model\.safetensors has \d+ bytes, manifest says \d+"):
        verify_checkpoint_files(path, ["model.safetensors"])
    (tmp_path / "vidstab" / "checkpoints" / "step_000003" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint_files(path)


def test_sha256_manifests_old_and_opt_in_still_validate(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    want = _weights(model)
    # A manifest as vidstab wrote it before crc32 became the default: {"bytes", "sha256"} per file.
    folder = tmp_path / "vidstab" / "checkpoints" / "step_000003"
    man = json.loads((folder / "manifest.json").read_text())
    man["files"] = {f: {"bytes": m["bytes"], "sha256": hashlib.sha256((folder / f).read_bytes()).hexdigest()}
                    for f, m in man["files"].items()}
    (folder / "manifest.json").write_text(json.dumps(man, indent=1))
    verify_checkpoint_files(folder)
    _perturb(model, opt, sched)
    assert ckpt.load("latest")["step"] == 3
    assert all(torch.equal(_weights(model)[k], v) for k, v in want.items())
    # An entry without any checksum is not trusted.
    no_sum = json.loads(json.dumps(man))
    no_sum["files"]["model.safetensors"] = {"bytes": man["files"]["model.safetensors"]["bytes"]}
    (folder / "manifest.json").write_text(json.dumps(no_sum))
    with pytest.raises(CheckpointError, match="records no checksum for model.safetensors"):
        verify_checkpoint_files(folder)
    (folder / "manifest.json").write_text(json.dumps(man))
    _flip_bit(folder / "model.safetensors", bit=0)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt \(sha256 mismatch\)"):
        verify_checkpoint_files(folder)

    # checksum="sha256" writes sha256 entries; a manager with the crc32 default loads them.
    acc2, model2, opt2, sched2, ckpt2 = _setup(tmp_path / "b", CheckpointConfig(async_save=False, checksum="sha256"))
    path = ckpt2.save(4, healthy=True, trainer_state={"step": 4})
    man = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert all(set(m) == {"bytes", "sha256"} for m in man["files"].values())
    loader = CheckpointManager(acc2, str(tmp_path / "b"), CheckpointConfig(async_save=False))
    for n, o in (("model", model2), ("optimizer", opt2), ("lr_scheduler", sched2)):
        loader.register(n, o)
    assert loader.load("latest")["step"] == 4
    with pytest.raises(ValueError, match="checksum"):
        CheckpointManager(acc2, str(tmp_path / "c"), CheckpointConfig(checksum="md5"))


def test_stale_temp_folders_are_removed_and_never_loaded(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    root = tmp_path / "vidstab" / "checkpoints"
    stale = root / ".tmp-step_000009-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (root / "step_000010").mkdir()  # a folder without manifest (e.g. copied by hand, incomplete)
    assert ckpt.load("latest")["step"] == 3
    CheckpointManager(acc, str(tmp_path), CheckpointConfig())
    assert not stale.exists()


def test_same_step_saved_again_replaces_it(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    ckpt.save(3, healthy=True, trainer_state={"step": 3, "v": 1})
    ckpt.save(3, healthy=True, trainer_state={"step": 3, "v": 2})
    assert ckpt.load("latest")["v"] == 2
    assert [i.name for i in ckpt.list()] == ["step_000003"]


def test_load_a_named_checkpoint_and_bad_state_is_refused_cleanly(tmp_path):
    acc, model, opt, sched, ckpt = _setup(tmp_path)
    for s in (3, 4):
        ckpt.save(s, healthy=True, trainer_state={"step": s})
    assert [i.step for i in ckpt.list()] == [3, 4]
    assert ckpt.load("vidstab/checkpoints/step_000003")["step"] == 3  # relative to the run folder
    assert ckpt.load(str(tmp_path / "vidstab" / "checkpoints" / "step_000004"))["step"] == 4
    with pytest.raises(CheckpointError, match="step_000005.*trainer_state"):
        ckpt.save(5, healthy=True, trainer_state={"step": 5, "oops": torch.zeros(1)})
    assert [i.step for i in ckpt.list()] == [3, 4]
    assert not [n for n in os.listdir(tmp_path / "vidstab" / "checkpoints") if n.startswith(".tmp-")]


def test_exact_resume_in_process_is_bitwise(tmp_path):
    """Stop at step 5, resume from `latest` in a fresh Accelerator with differently initialised weights:
    the losses afterwards and the final weights equal the uninterrupted run's, bit for bit."""

    def fresh():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    ref = ckpt_train.train(str(tmp_path / "ref"), steps=16, hidden=32)
    fresh()
    ckpt_train.train(str(tmp_path / "run"), steps=5, hidden=32, async_save=True)
    fresh()
    resumed = ckpt_train.train(str(tmp_path / "run"), steps=16, hidden=32, init_seed=99, async_save=True)
    assert sorted(resumed) == list(range(6, 17))
    assert all(float.hex(resumed[s]) == float.hex(ref[s]) for s in resumed)
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "ref" / "final.safetensors")), load_file(str(tmp_path / "run" / "final.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


_DISK_FULL = textwrap.dedent("""
    import resource, signal, sys, torch
    from accelerate import Accelerator
    from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(256, 256))
    ckpt = CheckpointManager(acc, sys.argv[1], CheckpointConfig(async_save=sys.argv[2] == "async"))
    ckpt.register("model", model)
    ckpt.save(1, healthy=True, trainer_state={"step": 1}); ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # model.safetensors is ~263 kB
    try:
        ckpt.save(2, healthy=True, trainer_state={"step": 2}); ckpt.wait()
    except CheckpointError as e:
        print("ERROR:", e); sys.exit(3)
    sys.exit(0)
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_during_save_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path, mode):
    r = subprocess.run([sys.executable, "-c", _DISK_FULL, str(tmp_path), mode], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "checkpoint step_000002 could not be written" in r.stdout and "File too large" in r.stdout
    root = tmp_path / "vidstab" / "checkpoints"
    assert sorted(os.listdir(root)) == ["last_good", "latest", "step_000001"]  # temp folder removed
    assert (root / "latest").read_text().strip() == "step_000001"
    acc = Accelerator(cpu=True)
    ckpt = CheckpointManager(acc, str(tmp_path))
    ckpt.register("model", acc.prepare(torch.nn.Linear(256, 256)))
    assert ckpt.load("latest")["step"] == 1


def _launch_two(script: str, out, *args: str) -> subprocess.CompletedProcess:
    """``tests/scripts/{script} out *args`` on 2 real CPU processes (gloo, an ``Accelerator`` on each) under torchrun."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(torchrun_cmd(2, os.path.join(os.path.dirname(__file__), "scripts", script), str(out), *args),
                          capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.slow
def test_two_processes_save_load_and_a_failure_on_one_rank(tmp_path):
    """Real 2-process DDP on CPU: per-rank RNG files, and a write error on rank 1 raises on both ranks; a rollback
    from the in-memory copy restores the same bits as one from the files on both ranks."""
    r = _launch_two("ckpt_ddp.py", tmp_path)
    for mode in ("async", "sync", "memory"):  # memory: tests/test_rollback_memory.py
        assert f"OK rank 0 {mode}" in r.stdout and f"OK rank 1 {mode}" in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0 got: checkpoint step_000004 could not be written: rank 1 failed" in r.stdout


@pytest.mark.slow
def test_a_rank_stalled_between_creating_and_writing_its_files_does_not_break_the_save(tmp_path):
    """A non-main rank's files (and its report that they are done) are never taken half-written."""
    r = _launch_two("ckpt_marker_race.py", tmp_path)
    for mode in ("sync", "async"):
        assert f"OK rank 0 {mode}" in r.stdout and f"OK rank 1 {mode}" in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_replicated_state_is_identical_on_every_rank_after_a_load(tmp_path):
    """Node-local folders whose guard state differs (a stale copy on one node) give every
    rank rank 0's state, or a clear refusal; never replicas that decide differently."""
    for node, mult in (("node0", 0.25), ("node1", 1.0)):
        if node == "node1":  # one run on two nodes: the same run id (node-local storage under one run folder)
            (tmp_path / node).mkdir()
            shutil.copy(tmp_path / "node0" / RUN_ID_FILE, tmp_path / node / RUN_ID_FILE)
        AcceleratorState._reset_state(True)
        acc = Accelerator(cpu=True)
        guard = GuardStandIn()
        guard.state["lr_multiplier"] = mult
        ckpt = CheckpointManager(acc, str(tmp_path / node), CheckpointConfig(async_save=False))
        ckpt.register("model", acc.prepare(torch.nn.Linear(4, 4)))
        ckpt.register("vidstab", guard)
        ckpt.save(2, trainer_state={"step": 2})
    r = _launch_two("ckpt_replicas.py", tmp_path)
    for mode in ("repair", "refuse"):
        assert f"OK rank 0 {mode}" in r.stdout and f"OK rank 1 {mode}" in r.stdout, r.stdout + r.stderr[-3000:]
