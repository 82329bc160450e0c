"""Preflight per shape bucket (vidstab/tools/audit/memory.py): one forward, backward and optimizer step per bucket
at its largest micro-batch, its peak memory and headroom, said plainly how it was measured (a CPU here: the
profiler's memory accounting); a bucket over the device's budget (the ``oom_batch_above`` drill) does not fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vidstab.tools.audit.memory import audit_bucket_memory
from vidstab.tools.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_vidstab_audit_memory_lists_every_bucket_of_the_bucketed_workload(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks.scenarios.buckets: the built-in bucketed Wan workload
    out = tmp_path / "audit.json"
    code = main(["audit", "--model", "benchmarks.scenarios.buckets:audit_factory", "--memory",
                 "--inject_fault", "oom_batch_above@0=8", "--json", str(out)])
    assert code == 1  # blocked: one bucket does not fit a device of 8 samples
    findings = json.loads(out.read_text())["findings"]
    (method,) = [f for f in findings if f["check"] == "memory.method"]
    assert "CPU" in method["message"] and "profiler's memory accounting" in method["message"]
    buckets = {f["details"]["bucket"]: f for f in findings if f["check"] == "memory.bucket"}
    from benchmarks.scenarios.buckets import BUCKETS

    assert sorted(buckets) == sorted(b.key for b in BUCKETS)
    for b in BUCKETS:
        f = buckets[b.key]
        assert f["details"]["micro_batch"] == b.batch
        if b.batch > 8:
            assert f["severity"] == "block" and not f["details"]["fits"]
            assert f["message"].startswith(f"bucket {b.key} does not fit: a step at a micro-batch of {b.batch} ran "
                                           f"out of memory")
        else:
            assert f["severity"] == "info" and f["details"]["fits"] and f["details"]["peak_bytes"] > 0
            assert f"bucket {b.key} at a micro-batch of {b.batch}: peak " in f["message"]
            assert "headroom" in f["message"] and f["details"]["headroom_bytes"] > 0
    table = capsys.readouterr().out
    assert "does not fit" in table and "BLOCKED" in table


def test_the_preflight_leaves_the_model_and_optimizer_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = {"small": torch.randn(4, 16), "large": torch.randn(256, 16)}
    found = audit_bucket_memory(model, opt, {k: (len(v), lambda v=v: model(v).square().mean()) for k, v in x.items()})
    peaks = {f["details"]["bucket"]: f["details"]["peak_bytes"] for f in found if f["check"] == "memory.bucket"}
    assert peaks["large"] > peaks["small"] > 0  # the activations of 256 samples over those of 4
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state and all(p.grad is None for p in model.parameters())
