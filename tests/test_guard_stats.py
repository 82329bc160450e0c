"""The gathered table -> StepStats in one pass over the rows: the same statistics as the per-field reading.

``build_stats`` runs every optimizer step on every rank; it reads each row once. The reference below is the
per-field reading (one comprehension per field); both must agree on random tables of 1-5 ranks with
non-finite norms, losses and inputs, exceptions, buckets, parameter norms and scales, in both encodings of
the counts: rows that count non-finite input values and losses on the device, and rows that carry one
micro-step's loss raw and leave non-finite inputs to the absmax columns (``vidstab.signals``).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from vidstab import signals as S
from vidstab.detectors import StepStats
from vidstab.guard.stats import _rms, build_stats


def reference_build_stats(step, table, layout, *, max_grad_norm, norm_known, sharded, scale_known, has_scaler,
                          lr, lr_peak, lr_scheduled):
    norms = [r[S.GRAD_NORM] for r in table]
    bad = [n for n in norms if not math.isfinite(n)]
    grad_norm = bad[0] if bad else max(norms)
    raw = [r[S.LOSS_TOTAL] == 1 and not math.isfinite(r[S.LOSS_SUM]) for r in table]  # one micro-step, raw loss
    bad_losses = [1.0 if w else r[S.LOSS_NONFINITE] for r, w in zip(table, raw)]
    sums = [0.0 if w else r[S.LOSS_SUM] for r, w in zip(table, raw)]
    counts = [r[S.LOSS_TOTAL] - b for r, b in zip(table, bad_losses)]
    loss_sum, loss_cnt = sum(sums), sum(counts)
    rank_loss = [x / c if c > 0 else math.nan for x, c in zip(sums, counts)]
    buckets = []
    if layout.buckets:
        sums = [sum(col) for col in zip(*(r[layout.bucket_sum] for r in table))]
        cnts = [sum(col) for col in zip(*(r[layout.bucket_count] for r in table))]
        buckets = [x / c if c > 0 else None for x, c in zip(sums, cnts)]
    param_norm = update_ratio = None
    if table[0][S.PARAM_PENDING] > 0:
        psq = sum(r[S.PARAM_SQ] for r in table) if sharded else table[0][S.PARAM_SQ]
        usq = sum(r[S.UPDATE_SQ] for r in table) if sharded else table[0][S.UPDATE_SQ]
        param_norm = math.sqrt(psq) if psq >= 0 else math.nan
        update_ratio = math.sqrt(usq) / param_norm if param_norm and math.isfinite(param_norm) and usq >= 0 else None
    absmax = [max(r[S.IN_ABSMAX_HI], r[S.IN_ABSMAX_LO]) if r[S.IN_NUMEL] > 0 else 0.0 for r in table]
    in_nonfinite = [r[S.NONFINITE_ALL] - r[S.LOSS_NONFINITE] > 0 or (r[S.IN_NUMEL] > 0 and not (
        math.isfinite(r[S.IN_ABSMAX_HI]) and math.isfinite(r[S.IN_ABSMAX_LO]))) for r in table]
    absmax = [a if math.isfinite(a) or not n else math.nan for a, n in zip(absmax, in_nonfinite)]
    s = StepStats(
        step=step, grad_norm=grad_norm if norm_known else math.nan, grad_norm_known=norm_known,
        loss=loss_sum / loss_cnt if loss_cnt > 0 else math.nan, world_size=len(table), max_grad_norm=max_grad_norm,
        clipped=bool(max_grad_norm is not None and math.isfinite(grad_norm) and grad_norm > max_grad_norm),
        lr=lr, loss_scale=table[0][S.LOSS_SCALE] if scale_known else None, lr_peak=lr_peak, lr_scheduled=lr_scheduled,
        param_norm=param_norm, update_ratio=update_ratio,
        nonfinite_loss_ranks=[i for i, b in enumerate(bad_losses) if b > 0],
        nonfinite_input_ranks=[i for i, n in enumerate(in_nonfinite) if n],
        exception_ranks=[i for i, r in enumerate(table) if r[S.EXCEPTIONS] > 0],
        rank_loss=rank_loss, rank_input_absmax=absmax, rank_seconds=[r[S.LOCAL_SECONDS] for r in table],
        timestep_bucket_loss=buckets, input_absmax=max((a for a in absmax if math.isfinite(a)), default=0.0),
        input_nonfinite=sum(in_nonfinite),
        input_rms=_rms(sum(r[S.IN_SUMSQ] for r in table), sum(r[S.IN_NUMEL] for r in table)),
    )
    s.overflow = bool(has_scaler and norm_known and not math.isfinite(grad_norm)
                      and not (s.nonfinite_loss_ranks or s.nonfinite_input_ranks or s.exception_ranks))
    return s


def random_row(rng, layout):
    row = [0.0] * layout.width
    odd = lambda p, x: (rng.choice([math.nan, math.inf, -math.inf]) if rng.random() < p else x)  # noqa: E731
    micro = rng.choice([1, 1, 2, 4])
    row[S.GRAD_NORM] = odd(0.1, rng.uniform(0.0, 5.0))
    bad_losses = rng.choice([0] * 8 + [1, micro])
    row[S.LOSS_TOTAL], row[S.LOSS_NONFINITE] = float(micro), float(bad_losses)
    row[S.LOSS_SUM] = sum(rng.uniform(0.1, 2.0) for _ in range(micro - bad_losses))
    numel = rng.choice([0.0, 4096.0, 8192.0])
    bad_inputs = float(rng.choice([0] * 8 + [1, 37])) if numel else 0.0
    row[S.IN_NUMEL] = numel
    if numel:
        hi, lo = rng.uniform(0.0, 6.0), rng.uniform(0.0, 6.0)
        row[S.IN_ABSMAX_HI] = odd(1.0, hi) if bad_inputs else odd(0.03, hi)  # a non-finite absmax without a count: overflow
        row[S.IN_ABSMAX_LO] = lo
        row[S.IN_SUM] = rng.uniform(-50, 50)
        row[S.IN_SUMSQ] = rng.choice([math.nan, math.inf]) if bad_inputs else numel * rng.uniform(0.5, 2.0)
    row[S.NONFINITE_ALL] = bad_inputs + bad_losses
    if rng.random() < 0.5:  # the device's encoding: no input count, one micro-step's loss carried raw
        row[S.NONFINITE_ALL] = bad_losses
        if micro == 1:
            row[S.LOSS_SUM] = rng.choice([math.nan, math.inf]) if bad_losses else row[S.LOSS_SUM]
            row[S.LOSS_NONFINITE] = row[S.NONFINITE_ALL] = 0.0
    row[S.EXCEPTIONS] = float(rng.random() < 0.05)
    row[S.LOCAL_SECONDS] = rng.choice([-1.0, rng.uniform(0.001, 0.05)])
    row[S.LOSS_SCALE] = 65536.0
    no_buckets = rng.random() < 0.2  # the attached loop passes no per-sample losses: every count 0
    for b in range(layout.buckets):
        count = 0.0 if no_buckets else rng.choice([0.0, 1.0, 3.0])
        row[layout.bucket_sum.start + b], row[layout.bucket_count.start + b] = count * rng.uniform(0, 2), count
    return row


@pytest.mark.parametrize("world", [1, 2, 5])
def test_one_pass_build_stats_equals_the_per_field_reading(world):
    rng = random.Random(world)
    for trial in range(400):
        layout = S.Layout(rng.choice([0, 4]))
        table = [random_row(rng, layout) for _ in range(world)]
        pending = rng.random() < 0.3
        for r in table:
            r[S.PARAM_PENDING] = float(pending)
            r[S.PARAM_SQ], r[S.UPDATE_SQ] = rng.choice([100.0, math.nan, -1.0]), rng.choice([0.01, -1.0])
        kw = dict(max_grad_norm=rng.choice([None, 1.0]), norm_known=rng.random() > 0.1, sharded=rng.random() < 0.5,
                  scale_known=rng.random() < 0.3, has_scaler=rng.random() < 0.3, lr=1e-4, lr_peak=1e-4, lr_scheduled=None)
        got, want = build_stats(trial, table, layout, **kw), reference_build_stats(trial, table, layout, **kw)
        g, w = dataclasses.asdict(got), dataclasses.asdict(want)
        assert repr(g) == repr(w), (trial, table)  # repr: NaN == NaN, and -0.0 != 0.0


@pytest.mark.parametrize("micro_steps,tensors,buckets", [(1, 1, 10), (1, 0, 0), (3, 2, 10), (2, 1, 0), (1, 3, 4)])
def test_a_one_process_row_finished_on_the_host_is_the_gathered_row(micro_steps, tensors, buckets):
    """``Window.pack_for_host`` (one process: nothing gathered) gives the row ``Window.pack`` builds, NaN,
    inf, bf16 inputs, several micro-steps and timestep buckets included."""
    gen = torch.Generator().manual_seed(micro_steps * 10 + tensors)
    w = S.Window(torch.device("cpu"), buckets, 1000)
    for m in range(micro_steps):
        batch = {}
        for j in range(tensors):
            x = torch.randn(2, 3, 4, generator=gen) * (j + 1)
            if (m + j) % 3 == 1:
                x[0, 1, 2] = float("nan") if j % 2 else float("inf")
            batch[f"x{j}"] = x.bfloat16() if j == 2 else x
        loss = torch.tensor(float("nan") if m == 1 else 0.25 + m)
        per_sample, t = torch.rand(2, generator=gen), torch.tensor([10.0, 990.0])
        w.record(loss, batch, per_sample if buckets else None, t if buckets else None, error=m == 2)
    args = (torch.tensor(1.5), True, torch.tensor(4.0), None, None, 0.125)
    expected = w.pack(*args).tolist()
    got = S.gather_and_read(None, w.pack_for_host(*args))[0]
    assert len(got) == len(expected) == S.Layout(buckets).width
    for col, (a, b) in enumerate(zip(got, expected)):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6), (col, a, b)


def test_the_screen_values_read_off_the_raw_one_process_row_are_those_of_the_finished_row():
    """``host_row_values`` (a healthy step's screen, reading the raw read without finishing the row) gives exactly
    what ``row_values`` reads off the finished row, None included: one micro-step with zero, one or two input
    tensors (its own path), and the layouts it hands over (several micro-steps, bucket losses, a loss scale,
    the parameter sums), through NaN and inf losses, inputs and norms, an exception and a stop request."""
    from vidstab.guard.healthy import host_row_values, row_values

    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    special = [1.0, math.nan, math.inf, -math.inf]
    seen_none = seen_fast = 0
    for trial in range(600):
        buckets = rng.choice([0, 0, 4])
        w = S.Window(torch.device("cpu"), buckets, 1000)
        micro_steps = rng.choice([1, 1, 1, 2])
        tensors = rng.choice([0, 1, 1, 1, 2])
        for m in range(micro_steps):
            batch = {}
            for j in range(tensors):
                x = torch.randn(2, 3, 4, generator=gen) * rng.choice([0.5, 3.0])
                if rng.random() < 0.1:
                    x[0, 1, 2] = rng.choice(special[1:])
                batch[f"x{j}"] = x
            loss = torch.tensor(rng.choice([0.25, 0.5]) if rng.random() > 0.1 else rng.choice(special[1:]))
            per_sample, t = torch.rand(2, generator=gen), torch.tensor([10.0, 990.0])
            with_buckets = buckets and rng.random() < 0.5
            w.record(loss, batch, per_sample if with_buckets else None, t if with_buckets else None,
                     error=rng.random() < 0.05)
        measured = rng.random() < 0.3
        norm = None if rng.random() < 0.05 else torch.tensor(rng.choice([0.7, 3.0, *special[1:]]))
        row = w.pack_for_host(norm, rng.random() < 0.05, torch.tensor(rng.choice([100.0, math.nan])) if measured else None,
                              torch.tensor(0.01) if measured else None, torch.tensor(2.0**16) if rng.random() < 0.05 else None,
                              0.125)
        table = S.gather_and_read(None, row)
        lr = rng.choice([None, 1e-4])
        args = (w.layout, rng.choice([None, 1.0]), lr, rng.choice([None, 1e-4]), rng.choice([None, lr]))
        got = host_row_values(table, *args)
        raw_path = table._row is None  # not finished: read off the raw values
        want = row_values(table[0], *args)
        assert repr(got) == repr(want), (trial, table[0])  # repr: NaN == NaN
        seen_none += got is None
        seen_fast += raw_path
        assert raw_path or not (micro_steps == 1 and not buckets and norm is not None
                                and table.present[3] is False), trial
    assert seen_none > 50 and seen_fast > 200  # both outcomes, mostly on the raw path


def test_detectors_with_nothing_to_judge_are_not_built_or_not_called(tmp_path):
    """A one-process guard has no ``straggler`` (no other rank to compare) and never calls ``lr_jump`` while
    the schedule's peak is known (``lr_bound`` judges the LR then); both still judge where they can."""
    from accelerate import Accelerator

    import vidstab
    from vidstab.config import GuardConfig
    from vidstab.detectors import build_detectors, judge

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    names = [d.name for d in guard.detectors]
    assert "straggler" not in names and "lr_jump" in names
    assert "straggler" in [d.name for d in build_detectors(GuardConfig(), world_size=2)]
    lr_jump = next(d for d in guard.detectors if d.name == "lr_jump")
    calls = []
    lr_jump.observe = lambda s, _observe=lr_jump.observe: calls.append(s.step) or _observe(s)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert guard.step_count == 3 and calls == []
    guard.close()
    # Without a known peak (a replayed row, an optimizer whose base LR the guard never saw) it judges.
    s = StepStats(step=0, grad_norm=1.0, loss=1.0, lr=1e-3)
    assert s.lr_unplaced == 1e-3 and StepStats(step=0, grad_norm=1.0, loss=1.0, lr=1e-3, lr_peak=1e-3).lr_unplaced is None
    judge([lr_jump], s)
    assert calls == [0]
