"""An out-of-memory inside ``optimizer.step()`` (the ``oom_in_step`` drill) under FSDP2 and DeepSpeed ZeRO 1/2/3, in
the attached and the explicit form, on 2 real processes, and on one process: one launch per world size
(tests/scripts/oom_engines.py), its cells one after another.

FSDP2 is judged like DDP (tests/test_oom_attached.py), from the local shards' version counters: untouched on
every rank, a skip with everything bitwise unchanged; touched on one rank, a rollback on every rank. DeepSpeed
updates and gathers inside its engine: the process stops with one message saying what to do, on every rank that
ran out of memory, and a peer left waiting in the engine's gather ends too (the launch ends, no hang)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")  # Accelerate's DeepSpeed plugin needs it

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import conformance_drill as drill  # noqa: E402
import oom_engines  # noqa: E402

from trainer_utils import REPO, torchrun_cmd, warm_run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("oom_engines")]

FSDP2 = ("explicit:fsdp2", "attached:fsdp2")
DDP = ("explicit:ddp", "attached:ddp")  # every cell of the conformance matrix's oom_in_step column runs here once
ZERO = ("explicit:zero1", "attached:zero1", "explicit:zero2", "attached:zero2", "explicit:zero3")
LAST = "attached:zero3"  # rank 1 alone runs out of memory: its process stops, the launch ends


SINGLE = ("explicit:single", "attached:single")  # the column's one-process cells


def _launch(out: Path, world: int, cells: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it would turn DeepSpeed off
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = torchrun_cmd(world, oom_engines.__file__, "--out", str(out), "--cells", ",".join(cells))
    return warm_run(cmd, env=env, timeout=600)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("oom_engines")
    return _launch(out, 2, [*FSDP2, *DDP, *ZERO, LAST]), out


@pytest.fixture(scope="module")
def launched_single(tmp_path_factory):
    out = tmp_path_factory.mktemp("oom_engines_single")
    return _launch(out, 1, list(SINGLE)), out


@pytest.fixture(scope="module")
def launched16(tmp_path_factory):
    out = tmp_path_factory.mktemp("oom_engines16")
    return _launch(out, 16, list(DDP)), out


def _evaluated(launched, cell: str, world: int) -> dict:
    """``oom_engines.evaluate`` of ``cell`` in a launch that ended with exit code 0."""
    proc, out = launched
    assert proc.returncode == 0, proc.stderr[-3000:]
    form, engine = cell.split(":")
    return oom_engines.evaluate(_cell(out, cell), form, engine, world)


@pytest.mark.parametrize("cell", DDP)
def test_on_16_processes_an_optimizer_oom_is_skipped_untouched_and_rolled_back_partway_bitwise(launched16, cell):
    assert _evaluated(launched16, cell, 16) == {"status": "pass"}


@pytest.mark.parametrize("cell", SINGLE)
def test_one_process_an_optimizer_oom_is_skipped_untouched_and_rolled_back_partway_bitwise(launched_single, cell):
    assert _evaluated(launched_single, cell, 1) == {"status": "pass"}


def _cell(out: Path, cell: str) -> Path:
    return out / cell.replace(":", "-")


def _traces(out: Path, cell: str) -> dict[int, list[dict]]:
    return oom_engines.traces(_cell(out, cell), 2)


def _optimizer_ooms(out: Path, cell: str) -> list[tuple]:
    return oom_engines.optimizer_ooms(_cell(out, cell))


@pytest.mark.parametrize("cell", FSDP2 + DDP)
def test_an_optimizer_oom_is_skipped_untouched_and_rolled_back_partway_bitwise(launched, cell):
    """The conformance matrix's oom_in_step assertions (oom_engines.evaluate): untouched on every rank, a skip with
    everything bitwise unchanged; touched on the last rank, a rollback on every rank to its checkpoint, the LR kept."""
    _, out = launched
    form, engine = cell.split(":")
    assert oom_engines.evaluate(_cell(out, cell), form, engine, 2) == {"status": "pass"}
    traces = _traces(out, cell)
    partway = oom_engines.PARTWAY
    assert traces[1][partway]["skipped"] and traces[1][partway]["before"]["weights"] != \
        traces[1][partway]["after"]["weights"]  # rank 1 updated part of its shard, then ran out of memory
    assert traces[0][partway]["applied"]


@pytest.mark.parametrize("cell", ZERO)
def test_deepspeed_an_optimizer_oom_stops_every_rank_with_what_to_do(launched, cell):
    _, out = launched
    form, engine = cell.split(":")
    result = oom_engines.evaluate(_cell(out, cell), form, engine, 2)
    assert result["status"] == "stopped", result


def test_deepspeed_an_optimizer_oom_on_one_rank_ends_the_launch_instead_of_hanging(launched):
    proc, out = launched
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0  # ended (the fixture's timeout bounds it): rank 1 stopped, rank 0 left the gather
    traces = _traces(out, LAST)
    assert "stopped" in traces[1][-1] and all("stopped" not in x for x in traces[0])
    assert "[rank1]: vidstab.recovery.oom.OptimizerStateDiverged: vidstab: step 1, rank 1: out of memory inside DeepSpeed" in log
    assert _optimizer_ooms(out, LAST) == [(1, 1, None)]
