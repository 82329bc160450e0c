"""Sharded (DCP) checkpoints of FSDP2 models with real processes; nothing on disk is a pickle or a zip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from vidstab.evidence.capture import INCIDENTS_DIR, write_incident
from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager

from trainer_utils import free_port

SCRIPTS = Path(__file__).resolve().parent / "scripts"

PICKLE_PROTOCOLS = tuple(bytes([0x80, p]) for p in range(2, 6))  # pickle protocol 2-5 opcode PROTO
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # torch.save writes a zip archive (of a pickle)


def run_procs(n: int, script: str, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    """``tests/scripts/{script}`` on ``n`` real CPU processes (torchrun, gloo) or plainly for ``n == 1``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPTS / script), *args]
    if n > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), *cmd[1:]]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def assert_no_pickle_or_zip(folder: Path) -> list[Path]:
    """Every file under ``folder``: neither a pickle nor a zip (torch.save) by content, whatever its name."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    for p in files:
        head = p.read_bytes()[:4]
        assert not head.startswith(PICKLE_PROTOCOLS), f"{p} is a pickle"
        assert not head.startswith(ZIP_MAGIC), f"{p} is a zip archive (torch.save?)"
    return files


@pytest.mark.slow
def test_fsdp2_sharded_checkpoints_round_trip_and_reshard_2_to_1_and_back(tmp_path):
    r = run_procs(2, "fsdp_ckpt.py", "save2", str(tmp_path))
    assert "OK save2 rank 0" in r.stdout and "OK save2 rank 1" in r.stdout, r.stdout + r.stderr[-4000:]
    assert "OK memory rank 0" in r.stdout and "OK memory rank 1" in r.stdout  # tests/test_rollback_memory.py
    # The mismatch names the parameter, on both ranks.
    assert r.stdout.count("model.blocks.0.weight has shape (12, 6) in the checkpoint, this run has (10, 6)") == 2
    r = run_procs(1, "fsdp_ckpt.py", "load1", str(tmp_path))
    assert "OK load1 rank 0" in r.stdout, r.stdout + r.stderr[-4000:]
    r = run_procs(2, "fsdp_ckpt.py", "load2", str(tmp_path))
    assert "OK load2 rank 0" in r.stdout and "OK load2 rank 1" in r.stdout, r.stdout + r.stderr[-4000:]
    for run in ("two", "one"):
        files = assert_no_pickle_or_zip(tmp_path / run / "vidstab" / "checkpoints")
        names = {p.name for p in files}
        assert not any(n.endswith((".metadata", ".pt", ".bin", ".pkl")) for n in names), names
        assert any(p.parent.name == "dcp" for p in files)


def test_no_checkpoint_or_incident_file_is_a_pickle_or_a_zip(tmp_path):
    """The full-state layout (single process) and an incident bundle, checked by content."""
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(4, 4))
    opt = acc.prepare(torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(async_save=False))
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    ckpt.save(1, trainer_state={"step": 1})
    write_incident(tmp_path, step=1, micro_step=0, rank=0, world_size=1, batch={"latents": torch.randn(2, 3)},
                   sample_ids=["a", "b"], finding={"detector": "nonfinite", "verdict": "SKIP", "message": "x",
                                                   "figures": {}},
                   lr=1e-3, precision="no", seed=0, checkpoint=tmp_path / "vidstab" / "checkpoints" / "step_000001",
                   model_spec=None)
    assert len(assert_no_pickle_or_zip(tmp_path / "vidstab" / "checkpoints")) >= 5
    assert len(assert_no_pickle_or_zip(tmp_path / INCIDENTS_DIR)) >= 2
    # The check itself catches torch.save output under an innocent name.
    torch.save({"x": torch.zeros(1)}, tmp_path / INCIDENTS_DIR / "sneaky.safetensors")
    with pytest.raises(AssertionError, match="zip"):
        assert_no_pickle_or_zip(tmp_path / INCIDENTS_DIR)


def test_deepspeed_pipeline_engine_is_refused_at_registration_with_the_reason(tmp_path):
    acc = Accelerator(cpu=True)

    class PipelineEngine(torch.nn.Module):  # DeepSpeed's pipeline engine, by type name
        pass

    ckpt = CheckpointManager(acc, str(tmp_path))
    with pytest.raises(CheckpointError, match=r"pipeline engine is not supported.*train_batch"):
        ckpt.register("model", PipelineEngine())


def _start_plain(n: int, script: str, *args: str, nodes: bool = False) -> list[subprocess.Popen]:
    """``n`` processes of ``script`` with the torch.distributed environment set and no launcher around them.
    ``nodes``: each process is its own node (LOCAL_RANK 0, GROUP_RANK its rank), as a multi-node torchrun sets."""
    port = free_port()
    procs = []
    for rank in range(n):
        local = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank)} if nodes else {
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n)}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(n), **local,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / script), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("mode,kind", [("async", "ddp"), ("async", "fsdp")])
def test_a_rank_killed_during_a_save_never_leaves_the_others_waiting(tmp_path, mode, kind):
    """Rank 1 is SIGKILLed mid-save with no elastic agent around; rank 0 exits on its own
    (the bound below is the 1800 s rank_timeout_s it used to wait, far above), with a clear message, and
    the half-written checkpoint is never loaded."""
    rank0, rank1 = _start_plain(2, "ckpt_dead_rank.py", str(tmp_path), mode, kind)
    try:
        out1, _ = rank1.communicate(timeout=120)
        assert rank1.returncode == -9, out1
        out0, _ = rank0.communicate(timeout=120)
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
    assert rank0.returncode == 3, out0[-3000:]
    assert "SURVIVOR rank 0: checkpoint step_000002 could not be written: lost contact with another rank" in out0
    root = tmp_path / "vidstab" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert not (root / "step_000002").exists()
    acc = Accelerator(cpu=True)
    # This process alone reads the 2-process checkpoint back, only to see that it is the intact previous one.
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(sharded=kind == "fsdp", allow_world_size_change=True))
    ckpt.register("model", torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    assert ckpt.load("latest")["step"] == 1
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]  # the remains were removed on start


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_save_on_each_node_publishes_a_complete_checkpoint_in_every_node_local_folder(tmp_path, kind):
    """Two one-process "nodes", each with its own folder (node-local disks): each node's local main process
    publishes the checkpoint there (its node's shards and RNG, the replicated state, manifest, pointers),
    and a restart on those folders loads it back bitwise on every rank."""
    procs = _start_plain(2, "ckpt_node_local.py", str(tmp_path / "node"), kind, nodes=True)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        finally:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RESTORED rank {rank} step 2" in out, out[-3000:]
        root = tmp_path / f"node{rank}" / "vidstab" / "checkpoints"
        assert (root / "latest").read_text().strip() == "step_000002"
        files = json.loads((root / "step_000002" / "manifest.json").read_text())["files"]
        assert f"rng-rank{rank}.json" in files and f"rng-rank{1 - rank}.json" not in files
        assert "trainer.json" in files and "optimizer.json" in files
        if kind == "fsdp":  # this node's rank's shard only, and it is on this node's disk
            assert [f for f in files if f.startswith("dcp/")] == [f"dcp/shard-0000{rank + 1}-model-00001-of-00001.safetensors"]
        else:
            assert "model.safetensors" in files
        assert all((root / "step_000002" / f).is_file() for f in files)
    if kind == "fsdp":
        # One node's folder alone cannot reshard to one process: refused, naming the tensor, nothing loaded.
        acc = Accelerator(cpu=True)
        ckpt = CheckpointManager(acc, str(tmp_path / "node0"), CheckpointConfig(allow_world_size_change=True, sharded=True))
        ckpt.register("model", torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
        with pytest.raises(CheckpointError, match=r"holds no shard for part of model\.0\.weight"):
            ckpt.load("latest")
