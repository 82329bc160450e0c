"""The one producer of a step's statistics against a plain reference computed from the raw per-micro-step values.

Each rank's micro-steps go through the real path: ``Window.record`` per micro-step, ``Window.pack`` (device ops)
into the rank's vector, the collective's SUM/MAX result (``signals.reduce_rows``: the multi-process tests run the
real all_reduce), ``build_stats`` and the metrics line. The reference never sees a vector: it is the textbook
definition of each statistic over the raw numbers each rank fed in (losses, input tensors, per-sample losses and
timesteps, norms, parameter sums). Random cases cover gradient accumulation 1-4, world size 1-4, timestep buckets,
a GradScaler's scale and NaN/Inf cells; changing a mean to a sum, or dropping a micro-step, anywhere in the path
fails it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from vidstab import signals as S
from vidstab.detectors import StepStats
from vidstab.guard.reporting import metrics_line
from vidstab.guard.stats import anomalous, build_stats

NB = 4  # timestep buckets
T = 1000.0  # num_train_timesteps


def random_rank(rng: random.Random, accum: int, rank: int, bad: bool) -> dict:
    """One rank's raw values for one optimizer step."""
    micro = []
    for _ in range(accum):
        b = rng.randint(1, 3)
        x = torch.randn(b, 2, 3, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * rng.uniform(0.1, 4)
        extra = torch.randn(b, 5, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) if rng.random() < 0.5 else None
        loss = rng.uniform(0.1, 2.0)
        if bad and rng.random() < 0.4:
            loss = rng.choice([math.nan, math.inf])
        if bad and rng.random() < 0.3:
            x.view(-1)[rng.randrange(x.numel())] = rng.choice([math.nan, math.inf, -math.inf])
        psl = torch.tensor([rng.uniform(0.1, 2.0) for _ in range(b)], dtype=torch.float64)
        if bad and rng.random() < 0.2:
            psl[0] = math.nan
        t = torch.tensor([rng.uniform(0, T - 1e-6) for _ in range(b)], dtype=torch.float64)
        micro.append(dict(loss=loss, inputs=[x] + ([extra] if extra is not None else []), psl=psl, t=t,
                          error=bad and rng.random() < 0.1))
    return dict(micro=micro, seconds=rng.choice([-1.0, rng.uniform(0.001, 0.5)]), rank=rank)


def vector(raw: dict, grad_norm, param_sums, scale, stop=False, lr=(1e-3, 1e-3, 1e-3)) -> list[float]:
    """The rank's vector through the real Window."""
    w = S.Window(torch.device("cpu"), NB, T)
    for m in raw["micro"]:
        batch = {f"in{i}": x for i, x in enumerate(m["inputs"])}
        w.record(torch.tensor(m["loss"]), batch, m["psl"], m["t"], m["error"], bucket="b")
    return w.pack(grad_norm, stop=stop, param_sq=param_sums[0], update_sq=param_sums[1], loss_scale=scale,
                  seconds=raw["seconds"], rank=raw["rank"], lr=lr,
                  batch_crc=raw.get("crc")).tolist()


def reference(ranks: list[dict], grad_norm, psq, usq, sharded, scale, max_grad_norm) -> dict:
    """The statistics by their definitions, over the raw values."""
    finite_losses = [m["loss"] for r in ranks for m in r["micro"] if math.isfinite(m["loss"])]
    bad_loss = [i for i, r in enumerate(ranks) if any(not math.isfinite(m["loss"]) for m in r["micro"])]
    values = [[v for m in r["micro"] for x in m["inputs"] for v in x.double().view(-1).tolist()] for r in ranks]
    bad_input = [i for i, vs in enumerate(values) if any(not math.isfinite(v) for v in vs)]
    ok = [vs for i, vs in enumerate(values) if i not in bad_input]
    flat = [v for vs in ok for v in vs]
    per_bucket = [[] for _ in range(NB)]
    for r in ranks:
        for m in r["micro"]:
            for loss, t in zip(m["psl"].tolist(), m["t"].tolist()):
                if math.isfinite(loss):
                    per_bucket[min(int(t * NB / T), NB - 1)].append(loss)
    timed = [(r["seconds"], i) for i, r in enumerate(ranks) if r["seconds"] >= 0]
    norm = grad_norm.item() if grad_norm is not None else math.nan
    measured = psq is not None
    p = (sum(psq) if sharded else psq[0]) if measured else None
    u = (sum(usq) if sharded else usq[0]) if measured else None
    rank_loss = []
    for r in ranks:
        fl = [m["loss"] for m in r["micro"] if math.isfinite(m["loss"])]
        rank_loss.append(sum(fl) / len(fl) if fl else math.nan)
    return dict(
        loss=sum(finite_losses) / len(finite_losses) if finite_losses else math.nan,
        grad_norm=norm, world_size=len(ranks),
        clipped=max_grad_norm is not None and math.isfinite(norm) and norm > max_grad_norm,
        nonfinite_loss_ranks=bad_loss, nonfinite_input_ranks=bad_input,
        exception_ranks=[i for i, r in enumerate(ranks) if any(m["error"] for m in r["micro"])],
        input_absmax=max((abs(v) for v in flat), default=0.0),
        input_rms=math.sqrt(sum(v * v for v in flat) / len(flat)) if flat else None,
        input_nonfinite=len(bad_input),
        timestep_bucket_loss=[sum(b) / len(b) if b else None for b in per_bucket],
        param_norm=math.sqrt(p) if measured else None,
        update_ratio=math.sqrt(u) / math.sqrt(p) if measured and p > 0 else None,
        loss_scale=scale.item() if scale is not None else None,
        slowest_rank=max(timed)[1] if timed else None,
        slowest_seconds=max(timed)[0] if timed else None,
        rank_loss=rank_loss,
        rank_input_absmax=[math.nan if i in bad_input else max((abs(v) for v in vs), default=0.0)
                           for i, vs in enumerate(values)],
        input_means=[sum(vs) / len(vs) if vs else None for vs in values],
        first_bad_rank=min(set(bad_loss) | set(bad_input) |
                           {i for i, r in enumerate(ranks) if any(m["error"] for m in r["micro"])}, default=None),
    )


def close(a, b, rel=1e-6) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, rel) for x, y in zip(a, b))
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=rel, abs_tol=1e-6)  # float32 sums of O(1) values


@pytest.mark.parametrize("seed", range(40))
def test_the_producer_equals_the_definitions_over_the_raw_values(seed):
    rng = random.Random(seed)
    world, accum = rng.randint(1, 4), rng.randint(1, 4)
    bad = rng.random() < 0.5
    ranks = [random_rank(rng, accum, r, bad and rng.random() < 0.6) for r in range(world)]
    grad_norm = torch.tensor(rng.choice([rng.uniform(0.1, 5), rng.uniform(0.1, 5), math.nan, math.inf]) if bad
                             else rng.uniform(0.1, 5))
    sharded, measured = rng.random() < 0.5, rng.random() < 0.5
    psq = [rng.uniform(1, 10) for _ in range(world)] if measured else None
    usq = [rng.uniform(0, 0.1) for _ in range(world)] if measured else None
    if measured and not sharded:  # DDP: every rank holds every parameter
        psq, usq = [psq[0]] * world, [usq[0]] * world
    scale = torch.tensor(float(2 ** rng.randint(0, 16))) if rng.random() < 0.3 else None
    max_grad_norm = rng.choice([None, 1.0])
    lrs = [1e-3 * (1000 if bad and rng.random() < 0.3 else 1) for _ in ranks]  # an LR bug on some ranks only
    crcs = [rng.randrange(1 << 32) if rng.random() < 0.7 else None for _ in ranks]
    for r, crc in zip(ranks, crcs):
        r["crc"] = crc
    rows = [vector(r, grad_norm, (torch.tensor(psq[i]), torch.tensor(usq[i])) if measured else (None, None), scale,
                   lr=(lrs[i], 1e-3, 1e-3)) for i, r in enumerate(ranks)]
    layout = S.Layout(NB)
    summary = S.reduce_rows(rows, layout)
    s = build_stats(3, summary, layout, rows=rows, bucket="b", max_grad_norm=max_grad_norm, sharded=sharded,
                    scale_known=scale is not None, has_scaler=scale is not None)
    ref = reference(ranks, grad_norm, psq, usq, sharded, scale, max_grad_norm)
    ref["lr"] = max(lrs)  # the largest LR any rank had: an LR bug on one rank is seen by every rank
    known = [c for c in crcs if c is not None]
    ref_fp = f"{sum(known) % (1 << 32):08x}" if known else None
    assert s.batch_fp == ref_fp and s.lr_peak == s.lr_scheduled == 1e-3
    for name, want in ref.items():
        if name == "input_means":
            continue
        if name == "slowest_seconds" and want is not None:  # carried in whole microseconds
            assert abs(s.slowest_seconds - want) <= 1e-6
            continue
        assert close(getattr(s, name), want), (name, getattr(s, name), want)
    assert s.bucket == "b" and s.step == 3
    assert s.overflow == (scale is not None and not math.isfinite(ref["grad_norm"]) and not (
        ref["nonfinite_loss_ranks"] or ref["nonfinite_input_ranks"] or ref["exception_ranks"]))
    assert anomalous(summary, layout) == bool(ref["nonfinite_loss_ranks"] or ref["nonfinite_input_ranks"]
                                              or ref["exception_ranks"] or not math.isfinite(ref["grad_norm"]))
    # Each rank's metrics line: the step's statistics and its own figures.
    for r, row in enumerate(rows):
        line = metrics_line(s, row, layout, r, 0.0, 0, 0)
        assert close(line["loss"], ref["loss"]) and close(line["loss_rank"], ref["rank_loss"][r])
        if r in ref["nonfinite_input_ranks"]:
            assert line["input_nonfinite"] == 1 and math.isnan(line["input_absmax"])
        else:
            assert line["input_nonfinite"] == 0 and close(line["input_mean"], ref["input_means"][r])
            assert close(line["input_absmax"], ref["rank_input_absmax"][r])


def test_without_rows_the_summary_alone_gives_the_same_step_figures():
    """A healthy step of many ranks is judged on the summary alone: every step-level figure is the one the rows
    give; only the per-rank lists are left empty."""
    rng = random.Random(7)
    ranks = [random_rank(rng, 2, r, False) for r in range(4)]
    rows = [vector(r, torch.tensor(0.5), (None, None), None) for r in ranks]
    layout = S.Layout(NB)
    summary = S.reduce_rows(rows, layout)
    kw = dict(bucket="b", max_grad_norm=1.0, sharded=False, scale_known=False, has_scaler=False)
    with_rows, alone = build_stats(0, summary, layout, rows=rows, **kw), build_stats(0, summary, layout, **kw)
    assert not anomalous(summary, layout)
    for f in StepStats.__dataclass_fields__:
        if not f.startswith("rank_"):
            assert close(getattr(alone, f), getattr(with_rows, f)) if isinstance(getattr(alone, f), (float, list)) \
                else getattr(alone, f) == getattr(with_rows, f), f
    assert alone.rank_loss == [] and len(with_rows.rank_loss) == 4


def test_a_step_of_ranks_in_different_buckets_is_mixed():
    layout = S.Layout(0)
    rows = []
    for rank, bucket in enumerate(["1x16x5x32x32", "1x16x5x32x32", "4x16x1x16x16"]):
        w = S.Window(torch.device("cpu"), 0, T)
        w.record(torch.tensor(1.0), {"latents": torch.ones(2, 3)}, bucket=bucket)
        rows.append(w.pack(torch.tensor(1.0), stop=False, param_sq=None, update_sq=None, loss_scale=None, seconds=0.1,
                           rank=rank).tolist())
    kw = dict(max_grad_norm=None, sharded=False, scale_known=False, has_scaler=False)
    assert build_stats(0, S.reduce_rows(rows, layout), layout, bucket="1x16x5x32x32", **kw).bucket == "mixed"
    assert build_stats(0, S.reduce_rows(rows[:2], layout), layout, bucket="1x16x5x32x32", **kw).bucket == "1x16x5x32x32"


def test_the_default_bucket_is_the_shape_of_the_input_with_the_most_dimensions():
    w = S.Window(torch.device("cpu"), 0, T)
    w.record(torch.tensor(1.0), {"text": torch.ones(2, 77, 8), "latents": torch.ones(2, 16, 5, 8, 8), "t": torch.ones(2)})
    assert w.shape_bucket == "2x16x5x8x8"
    w.record(torch.tensor(1.0), {"latents": torch.ones(1, 16, 9, 8, 8)})
    assert w.shape_bucket == "mixed"  # two micro-steps of different shapes in one window


def test_detectors_with_nothing_to_judge_are_not_built_or_not_called(tmp_path):
    """A one-process guard has no ``straggler`` (no other rank to compare) and never calls ``lr_jump`` while
    the schedule's peak is known (``lr_bound`` judges the LR then); both still judge where they can."""
    from accelerate import Accelerator

    import vidstab
    from vidstab.config import GuardConfig
    from vidstab.detectors.running import build_detectors, judge

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
