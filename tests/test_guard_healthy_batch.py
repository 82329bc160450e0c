"""Batched healthy steps (vidstab/guard/healthy.py) change nothing a user can see but the time they take.

The same unmodified Accelerate loop runs twice on one CPU process, once with the guard as it is (a step the
detectors' promises clear is applied at once and absorbed and logged later, with the others queued) and once
with every step judged on its own. Between the two: the same event log, line for line and in the same order
(metrics lines of queued steps before the findings that follow them; the clock's ``time`` and
``local_seconds`` aside), the same result of every
step, the same guard state at a checkpoint and at the end, through a NaN batch, an LR written by hand, a loss
spike and a rollback's ``load_state_dict``; and most steps take the batched path.
"""

from __future__ import annotations

import json
import math

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import vidstab
from vidstab.detectors import screen_values
from vidstab.events import events_dir
from vidstab.guard.healthy import PARAM_NORM, QueuedStep, host_row_values, queued_stats, row_values


class TinyDenoiser(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(4, 16, 1)
        self.t = torch.nn.Linear(1, 16)
        self.out = torch.nn.Conv3d(16, 4, 1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h = self.inp(sample) + self.t(timestep.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(torch.nn.functional.silu(h))


STEPS, NAN_AT, LR_AT, SPIKE_AT, SAVE_AT, ROLLBACK_AT = 420, 150, 260, 330, 200, 360


def run(run_dir, batched: bool):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = TinyDenoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    guard = vidstab.attach(accelerator, model, optimizer, scheduler, run_dir=run_dir)
    compared, built_stats, raw_compared = [], [], []
    if not batched:
        guard._batchable = False  # the reference: every step judged on its own
        build = guard._build_stats

        def build_and_compare(step, table, max_grad_norm, norm_known, lr=None):
            """What the batched path reads off the row is what the built stats hold (SCREEN_FIELDS order)."""
            stats = build(step, table, max_grad_norm, norm_known, lr)
            values = row_values(table[0], guard.window.layout, max_grad_norm, stats.lr, stats.lr_peak, stats.lr_scheduled)
            # the healthy step's screen reads the raw row (host_row_values): the same values, None included
            raw = host_row_values(table, guard.window.layout, max_grad_norm, stats.lr, stats.lr_peak, stats.lr_scheduled)
            raw_compared.append((step, repr(raw) == repr(values)))
            if values is not None:
                compared.append((step, values, tuple(None if v == [] else v for v in screen_values(stats))))
                # a queued step's stats are built from these values (queued_stats): the same as build_stats'
                queued = QueuedStep(step, table, max_grad_norm, stats.lr, stats.lr_peak, stats.lr_scheduled,
                                    True, 0.0, values)
                lean = queued_stats(queued, guard.window.layout)
                if lean is not None:
                    built_stats.append((repr(lean), repr(stats)))
            return stats

        guard._build_stats = build_and_compare
    g = torch.Generator().manual_seed(1)
    results, saved, snapshot = [], None, None
    for step in range(STEPS):
        latents = torch.randn(2, 4, 2, 4, 4, generator=g)
        noise = torch.randn(latents.shape, generator=g)
        t = torch.randint(0, 1000, (2,), generator=g)
        if step == NAN_AT:
            latents[0, 0, 0, 0, 0] = math.nan
        if step == LR_AT:
            optimizer.param_groups[0]["lr"] *= 100.0  # a user's bug: refused before it is applied
        target = noise * (30.0 if step == SPIKE_AT else 1.0)
        loss = torch.nn.functional.mse_loss(model(latents + noise, t), target)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        r = guard.last_result
        results.append(repr((r.step, r.applied, r.skipped, int(r.verdict), [f.detector for f in r.findings], r.loss,
                             r.grad_norm)))  # repr: a NaN loss equals itself
        if step == LR_AT:
            optimizer.param_groups[0]["lr"] /= 100.0
        if step == SAVE_AT:
            saved = json.loads(json.dumps(guard.state_dict()))  # what save_state writes (vidstab_guard.json)
            snapshot = saved
        if step == ROLLBACK_AT:
            guard.load_state_dict(snapshot)
    final = guard.state_dict()
    guard.close()
    lines = [json.loads(x) for x in (events_dir(run_dir) / "events-rank0.jsonl").read_text().splitlines()]
    for rec in lines:
        rec.pop("time")
        rec.pop("local_seconds", None)  # this rank's own compute time: the clock's, not the guard's
        if rec["kind"] == "start":
            rec.pop("config")
    return lines, results, saved, final, guard.steps_batched, compared, built_stats, raw_compared


def test_batched_healthy_steps_leave_the_same_log_results_and_state(tmp_path):
    batched = run(tmp_path / "batched", batched=True)
    judged = run(tmp_path / "judged", batched=False)
    lines, results, saved, final, count = batched[:5]
    assert results == judged[1]
    assert lines == judged[0]
    assert saved == judged[2] and final == judged[3]
    kinds = {rec["kind"] for rec in lines}
    assert {"skip", "warn", "metrics"} <= kinds, kinds  # the NaN batch, the LR, the spike were found
    before = [rec["step"] for rec in lines if rec["kind"] != "start"][:ROLLBACK_AT]
    assert before == sorted(before)  # every line in step order (until the rollback goes back)
    assert judged[4] == 0 and count > 0.6 * STEPS, count  # most steps took the batched path
    compared = judged[5]
    assert len(compared) > 0.9 * STEPS and sum(v[1][PARAM_NORM] is not None for v in compared) > STEPS / 20
    assert [c for c in compared if c[1] != c[2]] == []  # the row's values, field by field, are the stats'
    built = judged[6]
    assert len(built) > 0.9 * STEPS and [b for b in built if b[0] != b[1]] == []
    raw = judged[7]
    assert len(raw) == STEPS and [step for step, same in raw if not same] == []  # the NaN step's None included


def test_two_processes_batch_healthy_steps_alike_and_log_what_judging_every_step_logs(tmp_path):
    """Two real processes (DDP over gloo): every rank clears the same steps (the gathered table is the same
    everywhere), and each rank's log, results and state are those of judging every step, through a NaN batch on
    rank 1, a hand-written LR and a loss spike (``tests/scripts/batched_ddp.py``; the straggler detector runs and
    promises but cannot fire there, so the two runs' clocks cannot make them differ)."""
    from test_guard_distributed import launch

    runs = {}
    for mode, flags in (("batched", ()), ("judged", ("--judge_every_step",))):
        out = tmp_path / mode
        launch("batched_ddp.py", "--out", str(out), *flags, timeout=300)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        logs = []
        for r in (0, 1):
            lines = [json.loads(x) for x in (events_dir(out) / f"events-rank{r}.jsonl").read_text().splitlines()]
            for rec in lines:
                rec.pop("time")
                rec.pop("local_seconds", None)
                if rec["kind"] == "start":
                    rec.pop("config")
            logs.append(lines)
        for rank in ranks:
            rank["state"]["detectors"].pop("straggler")  # the ranks' measured times: the clock's, not the guard's
        runs[mode] = ranks, logs
    (batched, batched_logs), (judged, judged_logs) = runs["batched"], runs["judged"]
    for r in (0, 1):
        assert batched[r]["results"] == judged[r]["results"]
        assert batched_logs[r] == judged_logs[r]
        assert batched[r]["state"] == judged[r]["state"]
    assert batched[0]["results"] == batched[1]["results"]  # the same decision on every rank
    assert batched[0]["steps_batched"] == batched[1]["steps_batched"] > 0.5 * 240  # most steps batched, alike
    assert judged[0]["steps_batched"] == 0
    kinds = {rec["kind"] for rec in batched_logs[0]}
    assert {"skip", "warn", "metrics"} <= kinds, kinds
