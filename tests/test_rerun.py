"""Rerun on suspicion, in the reference trainer on 2 processes: a skipped step is re-run on
the same weights, in the job, and classified. A NaN sample (a data fault) reproduces everywhere: data, its
samples named and quarantined. An activation corrupted once on one rank (the flaky_activation fault, first
pass only) does not reproduce: transient, counted for that rank. A fault that stays on one rank reproduces
there but not on a peer running the same micro-batches: suspect hardware, naming rank and host. Under FSDP (every
rank reruns together, no peer check): the conformance matrix's FSDP2 row (tests/test_conformance.py)."""

from __future__ import annotations

import json

import pytest

from trainer_utils import events, run_trainers

from vidstab.recovery.quarantine import QuarantineList


def _reruns(out):
    return {r: events(out, r, kind="rerun") for r in (0, 1)}


@pytest.mark.slow
def test_a_data_fault_a_transient_fault_and_a_faulty_rank_are_each_classified(tmp_path):
    # One run, the three faults on rank 1 at different steps: each anomaly is re-run and classified on its own.
    out = tmp_path / "run"
    run_trainers((out, "--max_train_steps", "7", "--checkpointing_steps", "3", "--inject_fault", "nan_batch@2:1",
                  "--inject_fault", "flaky_activation@4:1", "--inject_fault", "inf_module@6:1=blocks.1.mlp"),
                 nproc=2, timeout=400)
    reruns = _reruns(out)
    assert [(e["step"], e["verdict"], e["ranks"]) for e in reruns[0]] == [
        (2, "data", [1]), (4, "transient", [1]), (6, "suspect_hardware", [1])]
    data, flaky, hardware = reruns[0]

    # Data: reproduced on rank 1 and by its peer; the samples named on rank 1 and quarantined.
    assert data["peer"] == {"1": True} and data["reproduced"]["1"] is True
    named = reruns[1][0]["samples"]
    assert len(named) == 4 and set(named) <= QuarantineList(out).ids()
    bundle = next((out / "vidstab" / "incidents").glob("step000002-rank1*"))
    assert json.loads((bundle / "incident.json").read_text())["rerun"]["verdict"] == "data"

    # Transient: not reproduced on rank 1; the run goes on, counted for rank 1, nothing more quarantined.
    assert flaky["transient_by_rank"] == {"1": 1} and reruns[1][1]["verdict"] == "transient"
    assert [e["step"] for e in events(out, kind="skip")][:2] == [2, 4] and QuarantineList(out).ids() == set(named)

    # Suspect hardware: rank 1 reproduces, its peer (rank 0) on the same micro-batches does not.
    assert hardware["peer"] == {"1": False}
    warn = [e for e in events(out, 1, kind="warn") if e["detector"] == "suspect_hardware"]
    assert len(warn) == 1 and warn[0]["host"] and warn[0]["host"] in warn[0]["message"]
    assert (out / "vidstab" / "suspect_hosts.txt").read_text().split() == [warn[0]["host"]]

    # What the rerun cost, on the anomalies only: no healthy step re-runs anything.
    assert all(e["seconds"] > 0 for r in (0, 1) for e in events(out, r, kind="rerun"))


def test_one_process_a_nan_sample_is_data_an_overflowing_layer_numerics_a_one_off_corruption_transient(tmp_path):
    import torch
    from accelerate import Accelerator

    import vidstab
    from vidstab.faults import add_flaky_activation, add_module_fault

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    guard.set_replay_fn(lambda b: (model(b["x"]) - b["x"]).pow(2).mean(dim=1))
    verdicts = {}
    for step in range(8):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ids = [f"s{step}-{i}" for i in range(4)]
        if step == 3:
            x[2, 5] = float("nan")  # a bad sample
        handle = add_flaky_activation(model, "0") if step == 6 else None  # one NaN activation, first pass only
        if step == 5:
            handle = add_module_fault(model, "1")  # a layer that overflows on clean inputs, every time
        loss = (model(x) - x).pow(2).mean()
        guard.backward(loss, batch={"x": x}, sample_ids=ids)
        result = guard.step(1.0)
        if handle is not None:
            handle.remove()
        if result.rerun is not None:
            verdicts[step] = result.rerun
    guard.close()
    assert sorted(verdicts) == [3, 5, 6]
    assert verdicts[5].verdict == "numerics" and verdicts[5].samples == []
    assert verdicts[3].verdict == "data" and verdicts[3].samples == ["s3-2"]
    assert verdicts[6].verdict == "transient" and verdicts[6].transient_by_rank == {"0": 1}
    assert QuarantineList(tmp_path).ids() == {"s3-2"}
    assert [e["verdict"] for e in events(tmp_path, kind="rerun")] == ["data", "numerics", "transient"]
