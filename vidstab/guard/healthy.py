"""A healthy step applied at once, absorbed and reported later: the guard's fixed cost per step (issue 16).

On most steps of a healthy run nothing is found, and the detectors' promises (:mod:`vidstab.detectors.screen`)
say so before any of them runs. For such a step the guard reads from the gathered row only the values the
promises bound (:func:`row_values`: the fields :data:`~vidstab.detectors.screen.SCREEN_FIELDS`, computed as
:func:`vidstab.guard.stats.build_stats` computes them, without building the stats; with one process
:func:`host_row_values`, straight from the raw read, the row itself finished only when its line is made) and asks
:meth:`Screen.admits <vidstab.detectors.screen.Screen.admits>`. A step it clears is applied at once and queued
(:class:`QueuedStep`); its statistics, detector updates and metrics line are made later, several steps in one
loop (:meth:`Guard._absorb_queued <vidstab.guard.Guard._absorb_queued>`, then ``_log_queued``): right after a
training step the CPU's caches are cold and every object touched costs a miss, and a loop over the queued steps,
detector by detector, pays for most of them once per batch, not once per step. On the small models of
``benchmarks/bench_guard_overhead.py`` that is 44-51 us less of the guard's own time per step by the mean
(``benchmarks/RESULTS.md``, "Batched healthy steps"; the batch itself still costs about twice its warm time).

The queue is emptied, in step order, before anything reads what it holds back: at the end of the step whose
successor the promises no longer cover (:meth:`Screen.admits` returns 0), before the detectors judge a step
the promises do not clear (the updates; the metrics lines wait until that step's optimizer step is enqueued),
before any other event is written and when the event log flushes, and in ``guard.state_dict``,
``load_state_dict`` and ``guard.detectors``. Findings, verdicts, detector states, thresholds and metrics
lines are those of judging every step (``tests/test_detector_screen.py``, ``tests/test_guard_healthy_batch.py``).
A crash loses the metrics lines of the queued steps (at most :data:`MAX_QUEUED`), never a finding: a step
with a finding is never queued.

Runs of several processes take it too: the gathered table is the same on every rank, so every rank clears the
same steps (:func:`table_values` reads the screen's values over the ranks as ``build_stats`` does), and the
``straggler`` detector, which compares the ranks' times, promises quiet steps for as long as no rank's streak
of slow steps can reach its ``patience`` (``tests/test_guard_healthy_batch.py`` runs two processes). Steps with
trackers to feed, a GradScaler scale, an exception, a stop request, non-finite values or timestep-bucket losses
are judged as before.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .. import signals as S
from ..detectors import SCREEN_FIELDS, StepStats, lr_ratios

MAX_QUEUED = 32
"""Most healthy steps held back at once (the queue is emptied at the end of the step that fills it)."""


class QueuedStep(NamedTuple):
    """What a cleared step leaves for its later absorption: :func:`vidstab.guard.stats.build_stats`'s inputs."""

    step: int
    table: "list[list[float]] | S.HostRow"
    max_grad_norm: float | None
    lr: float | None
    lr_peak: float | None
    lr_scheduled: float | None
    applied: bool
    time: float
    """When it was applied (its metrics line's ``time``)."""
    values: tuple
    """What :func:`host_row_values` or :func:`table_values` read off its table (:func:`queued_stats` builds on them)."""


def row_values(row: list[float], layout: S.Layout, max_grad_norm: float | None, lr: float | None,
               lr_peak: float | None, lr_scheduled: float | None) -> tuple | None:
    """The :data:`~vidstab.detectors.screen.SCREEN_FIELDS` of a one-process step from its row, in that order, with the
    arithmetic of :func:`~vidstab.guard.stats.build_stats` (the same floats); ``None`` when the row itself
    rules the step out: no gradient norm, an exception, a stop request, a non-finite loss, input or norm. The caller checks the scale (a GradScaler's steps are judged)."""
    if row[S.NORM_OK] != 1.0 or row[S.EXCEPTIONS] or row[S.STOP] or row[S.LOSS_NONFINITE] or row[S.NONFINITE_ALL]:
        return None
    grad_norm, total, loss_sum, numel = row[S.GRAD_NORM], row[S.LOSS_TOTAL], row[S.LOSS_SUM], row[S.IN_NUMEL]
    if not (total > 0 and math.isfinite(loss_sum) and math.isfinite(grad_norm)):
        return None
    absmax = 0.0
    if numel > 0:
        hi, lo = row[S.IN_ABSMAX_HI], row[S.IN_ABSMAX_LO]
        if not (math.isfinite(hi) and math.isfinite(lo)):
            return None
        absmax = max(hi, lo)
    sum_sq = 0.0 + row[S.IN_SUMSQ]
    filled = 0
    if layout.buckets:
        counts = row[layout.bucket_count]
        if any(counts):  # the attached loop passes no per-sample losses: all zero
            filled = sum(c > 0 for c in counts)
    param_norm = update_ratio = update_per_lr = None
    if row[S.PARAM_PENDING] > 0:  # as build_stats: one process, so the sums need no adding up
        param_norm, update_ratio, update_per_lr = _param_values(0 + row[S.PARAM_SQ], 0 + row[S.UPDATE_SQ], lr)
    to_peak, to_scheduled = lr_ratios(lr, lr_peak, lr_scheduled)
    # SCREEN_FIELDS order (tests/test_guard_healthy_batch.py compares with screen_values of the built stats)
    return (grad_norm, (0.0 + loss_sum) / (0.0 + total), max_grad_norm, lr, to_peak, to_scheduled,
            lr if lr_peak is None else None, absmax, math.sqrt(sum_sq / (0.0 + numel)) if numel > 0 else None, filled,
            param_norm, update_ratio, update_per_lr, None, None, None, None, None)


def host_row_values(table: S.HostRow, layout: S.Layout, max_grad_norm: float | None, lr: float | None,
                    lr_peak: float | None, lr_scheduled: float | None) -> tuple | None:
    """:func:`row_values` of a one-process step straight from its raw read (:class:`~vidstab.signals.HostRow`),
    without finishing the row (that waits until the step's metrics line is made, with the other held-back
    steps'): the same floats, for the common layout (one micro-step, no loss scale, no timestep-bucket losses,
    the parameter sums both present or both absent); any other row is finished and read by :func:`row_values`."""
    flat, host = table.flat, table.host
    has_norm, has_param, has_update, has_scale = table.present
    n = table.tensors
    at = 3 if has_param else 1  # raw: grad_norm, [param_sq, update_sq], loss, [max, min, sum, norm], [buckets]
    if (table.micro_steps != 1 or has_scale or not has_norm or has_param != has_update
            or len(flat) != at + 1 + 4 * n):  # (longer: bucket losses follow)
        return row_values(table[0], layout, max_grad_norm, lr, lr_peak, lr_scheduled)
    if host[_HOST_EXCEPTIONS] or host[_HOST_STOP]:
        return None
    grad_norm, loss_sum, numel = flat[0], flat[at], host[_HOST_IN_NUMEL]
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):  # (one micro-step: its loss count is 1)
        return None
    absmax, rms = 0.0, None
    if numel > 0:  # finish's columns: absmax from the largest |max| and |min|, the sum of squares from norm * norm
        hi = lo = sum_sq = 0.0  # the same float additions, in the same order, as finish
        for i in range(at + 1, at + 1 + 4 * n, 4):  # per tensor: max, min, sum, norm
            a, b, norm = abs(flat[i]), abs(flat[i + 1]), flat[i + 3]
            if not (math.isfinite(a) and math.isfinite(b)):
                return None
            if a > hi:
                hi = a
            if b > lo:
                lo = b
            sum_sq += norm * norm
        absmax = max(hi, lo)
        rms = math.sqrt((0.0 + sum_sq) / (0.0 + numel))
    param_norm = update_ratio = update_per_lr = None
    if has_param:
        param_norm, update_ratio, update_per_lr = _param_values(0 + flat[1], 0 + flat[2], lr)
    to_peak, to_scheduled = lr_ratios(lr, lr_peak, lr_scheduled)
    return (grad_norm, (0.0 + loss_sum) / 1.0, max_grad_norm, lr, to_peak, to_scheduled,
            lr if lr_peak is None else None, absmax, rms, 0,
            param_norm, update_ratio, update_per_lr, None, None, None, None, None)


def table_values(table: list[list[float]], layout: S.Layout, max_grad_norm: float | None, lr: float | None,
                 lr_peak: float | None, lr_scheduled: float | None, sharded: bool) -> tuple | None:
    """:func:`row_values` of a step of several processes, from the gathered ``[world, k]`` table (the same on every
    rank, so every rank clears the same steps): the values :func:`~vidstab.guard.stats.build_stats` computes over
    the ranks, with its arithmetic in its order (the same floats); ``None`` when a row rules the step out.
    ``sharded``: FSDP, the parameter sums of squares add up over the ranks."""
    grad_norm = None
    loss_sum = loss_cnt = sum_sq = numel = 0.0
    absmax = None
    for r in table:
        if r[S.NORM_OK] != 1.0 or r[S.EXCEPTIONS] or r[S.STOP] or r[S.LOSS_NONFINITE] or r[S.NONFINITE_ALL]:
            return None
        norm, total, rank_sum, rank_numel = r[S.GRAD_NORM], r[S.LOSS_TOTAL], r[S.LOSS_SUM], r[S.IN_NUMEL]
        if not (total > 0 and math.isfinite(rank_sum) and math.isfinite(norm)):
            return None
        if grad_norm is None or norm > grad_norm:
            grad_norm = norm
        loss_sum += rank_sum
        loss_cnt += total - r[S.LOSS_NONFINITE]  # as build_stats counts (0 here)
        rank_absmax = 0.0
        if rank_numel > 0:
            hi, lo = r[S.IN_ABSMAX_HI], r[S.IN_ABSMAX_LO]
            if not (math.isfinite(hi) and math.isfinite(lo)):
                return None
            rank_absmax = max(hi, lo)
        if absmax is None or rank_absmax > absmax:
            absmax = rank_absmax
        sum_sq += r[S.IN_SUMSQ]
        numel += rank_numel
    filled = 0
    if layout.buckets:
        counts = [sum(col) for col in zip(*(r[layout.bucket_count] for r in table))]
        if any(counts):
            filled = sum(c > 0 for c in counts)
    param_norm = update_ratio = update_per_lr = None
    first = table[0]
    if first[S.PARAM_PENDING] > 0:
        psq = sum(r[S.PARAM_SQ] for r in table) if sharded else first[S.PARAM_SQ]
        usq = sum(r[S.UPDATE_SQ] for r in table) if sharded else first[S.UPDATE_SQ]
        param_norm, update_ratio, update_per_lr = _param_values(psq, usq, lr)
    to_peak, to_scheduled = lr_ratios(lr, lr_peak, lr_scheduled)
    return (grad_norm, loss_sum / loss_cnt, max_grad_norm, lr, to_peak, to_scheduled,
            lr if lr_peak is None else None, absmax, math.sqrt(sum_sq / numel) if numel > 0 else None, filled,
            param_norm, update_ratio, update_per_lr, None, None, None, None, None)


def queued_stats(q: QueuedStep, layout: S.Layout) -> StepStats | None:
    """The :class:`~vidstab.detectors.StepStats` of a queued step of ONE process, as
    :func:`~vidstab.guard.stats.build_stats` makes them (the same floats: :func:`row_values` computed them with
    its arithmetic), from the values the screen read, without going over the row again: a batch builds one per
    step. ``None`` where the values do not say everything (timestep-bucket losses): build_stats then."""
    v = q.values
    if v[_FILLED]:
        return None
    grad_norm, max_norm, absmax = v[GRAD_NORM], q.max_grad_norm, v[_ABSMAX]
    return StepStats(
        step=q.step, grad_norm=grad_norm, loss=v[LOSS], world_size=1, grad_norm_known=True, max_grad_norm=max_norm,
        clipped=bool(max_norm is not None and grad_norm > max_norm),  # (finite: the screen admitted it)
        lr=q.lr, loss_scale=None, lr_peak=q.lr_peak, lr_scheduled=q.lr_scheduled,
        param_norm=v[PARAM_NORM], update_ratio=v[_UPDATE_RATIO], nonfinite_loss_ranks=[], nonfinite_input_ranks=[],
        exception_ranks=[], rank_loss=[v[LOSS]], rank_input_absmax=[absmax], rank_seconds=[q.table[0][S.LOCAL_SECONDS]],
        timestep_bucket_loss=[None] * layout.buckets, input_absmax=absmax, input_nonfinite=0, input_rms=v[_RMS])


def _param_values(psq: float, usq: float, lr: float | None) -> tuple:
    """``(param_norm, update_ratio, update_per_lr)`` from the sums of squares of a measured step, as
    ``build_stats`` and ``StepStats.update_per_lr`` compute them (one step in ``param_norm_every``)."""
    param_norm = math.sqrt(psq) if psq >= 0 else math.nan
    update_ratio = update_per_lr = None
    if param_norm and math.isfinite(param_norm) and usq >= 0:
        update_ratio = math.sqrt(usq) / param_norm
        update_per_lr = update_ratio if lr is None else update_ratio / lr if lr > 0 else None
    return param_norm, update_ratio, update_per_lr


GRAD_NORM, LOSS, PARAM_NORM = (SCREEN_FIELDS.index(f) for f in ("grad_norm", "loss", "param_norm"))
"""Positions in :func:`row_values`' tuple of what the guard reads itself."""
_HOST_EXCEPTIONS, _HOST_IN_NUMEL, _HOST_STOP = (c - S.DEVICE_COLS for c in (S.EXCEPTIONS, S.IN_NUMEL, S.STOP))
"""Positions in :attr:`HostRow.host <vidstab.signals.HostRow>` (the row's host-known columns, from ``NORM_OK`` on)."""
_ABSMAX, _RMS, _FILLED, _UPDATE_RATIO = (SCREEN_FIELDS.index(f) for f in (
    "input_absmax", "input_rms", "timestep_buckets_filled", "update_ratio"))
