"""The attached form (``vidstab.attach(..., rollback_every=N)``) under DeepSpeed ZeRO-2 and ZeRO-3 on 2 real CPU
processes, as a user's unmodified loop (tests/scripts/deepspeed_contract.py):

- the weights' norm and every verdict read only the real elements of each rank's partitions, whatever the
  padding holds (DeepSpeed leaves it uninitialised; the script writes NaN and 1e30 into it);
- the README's guarded loop, as the README shows it, runs on the engine (its own ``save_state`` on every rank).

A persistent LR fault under ``rollback_every`` (in-place rollbacks restoring the state bitwise, then one message on
the main process and exit code 3): the conformance matrix, tests/test_conformance.py, at every ZeRO stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")  # Accelerate's DeepSpeed plugin needs it

from trainer_utils import free_port, warm_run  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO = Path(__file__).resolve().parent.parent
LAUNCHES = {"a": "padding:3,readme:2,padding:2,readme:3"}  # one launch: the engines one after another


def launch(jobs: str, out: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it would turn DeepSpeed off
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(SCRIPTS / "deepspeed_contract.py"), "--out", str(out),
           "--jobs", jobs]
    return warm_run(cmd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ds_contract")
    return {name: (launch(jobs, out / name), out / name) for name, jobs in LAUNCHES.items()}


def folder(runs: dict, job: str) -> Path:
    name = next(n for n, jobs in LAUNCHES.items() if job in jobs.split(","))
    return runs[name][1] / job.replace(":", "-")


def events(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / "vidstab" / f"events-rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["3", "2"])
def test_the_weights_norm_reads_only_the_real_elements_of_each_partition(runs, stage):
    out = folder(runs, f"padding:{stage}")
    r0, r1 = (json.loads((out / f"padding-rank{r}.json").read_text()) for r in (0, 1))
    assert sum(r0["padding_written"]) + sum(r1["padding_written"]) > 0  # the model's partitions are padded
    for r in (r0, r1):  # no finding on any step: no false rollback, skip or warning
        assert all(s["verdict"] == "OK" and not s["detectors"] for s in r["steps"]), r["steps"]
    # The guard measures after step s and reports it with step s + 1: the gathered weights' norm, NaN padding or not.
    metrics = {e["step"]: e["param_norm"] for e in events(out) if e["kind"] == "metrics"}
    for s, norm in enumerate(r0["norms"][:-1]):
        assert metrics[s + 1] == pytest.approx(norm, rel=1e-5), (s, metrics[s + 1], norm)
    saves = [e for e in events(out) if e["kind"] == "checkpoint"]
    assert saves and all(e["healthy"] for e in saves)  # rollback checkpoints: finite, healthy
    for name in ("latest", "last_good"):
        assert (out / "vidstab" / "rollback" / name).read_text().strip() == f"step_{len(r0['norms']) - 1:06d}"
    assert not [e for e in events(out) if e["kind"] in ("rollback", "rollback_request", "skip", "warn")]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["2", "3"])
def test_the_readme_loop_runs_as_shown_under_deepspeed(runs, stage):
    out = folder(runs, f"readme:{stage}")
    for rank in (0, 1):
        assert json.loads((out / f"readme-rank{rank}.json").read_text()) == {"global_step": 6, "finite": True}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [e["detector"] for e in events(out) if e["kind"] == "skip"] == ["nonfinite"]  # the NaN sample
