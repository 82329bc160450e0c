"""Step 3's input: the gathered ``[world, k]`` table (:mod:`vidstab.signals`) read into one
:class:`~vidstab.detectors.StepStats`, the same on every rank. Pure host arithmetic on the table."""

from __future__ import annotations

import math
from typing import Sequence

from .. import signals as S
from ..detectors import StepStats, Verdict


def build_stats(
    step: int,
    table: list[list[float]],
    layout: S.Layout,
    *,
    max_grad_norm: float | None,
    norm_known: bool,
    sharded: bool,
    scale_known: bool,
    has_scaler: bool,
    lr: float | None,
    lr_peak: float | None,
    lr_scheduled: float | None,
) -> StepStats:
    """The statistics of one step from every rank's row.

    ``sharded``: FSDP, each rank holds a shard, so parameter/update sums of squares add up over ranks
    (under DDP every rank holds all parameters: rank 0's row is taken). ``scale_known``: the rows carry a
    GradScaler scale. ``has_scaler``: a non-finite norm with finite losses and inputs is an fp16 overflow.
    ``lr``/``lr_peak``/``lr_scheduled``: the guard's LR figures (:class:`vidstab.lr.LRMultiplier`).
    """
    isfinite, nan = math.isfinite, math.nan
    grad_norm = first_bad = best_absmax = None
    loss_sum = loss_cnt = sum_sq = numel = 0.0
    rank_loss, rank_absmax, rank_seconds = [], [], []
    nonfinite_loss_ranks, nonfinite_input_ranks, exception_ranks = [], [], []
    for i, r in enumerate(table):  # one pass over the rows (this runs every step, on every rank)
        norm = r[S.GRAD_NORM]
        if not isfinite(norm):
            if first_bad is None:
                first_bad = norm
        elif grad_norm is None or norm > grad_norm:
            grad_norm = norm
        rank_sum, bad_losses = S.loss_count(r)
        count = r[S.LOSS_TOTAL] - bad_losses
        loss_sum += rank_sum
        loss_cnt += count
        rank_loss.append(rank_sum / count if count > 0 else nan)
        bad_inputs = S.inputs_nonfinite(r)
        absmax = max(r[S.IN_ABSMAX_HI], r[S.IN_ABSMAX_LO]) if r[S.IN_NUMEL] > 0 else 0.0
        if isfinite(absmax):
            if best_absmax is None or absmax > best_absmax:
                best_absmax = absmax
        elif bad_inputs:
            absmax = nan
        rank_absmax.append(absmax)
        rank_seconds.append(r[S.LOCAL_SECONDS])
        sum_sq += r[S.IN_SUMSQ]
        numel += r[S.IN_NUMEL]
        if bad_losses > 0:
            nonfinite_loss_ranks.append(i)
        if bad_inputs:
            nonfinite_input_ranks.append(i)
        if r[S.EXCEPTIONS] > 0:
            exception_ranks.append(i)
    if first_bad is not None:
        grad_norm = first_bad
    buckets = _bucket_means(table, layout) if layout.buckets else []
    param_norm = update_ratio = None
    if table[0][S.PARAM_PENDING] > 0:
        psq = sum(r[S.PARAM_SQ] for r in table) if sharded else table[0][S.PARAM_SQ]
        usq = sum(r[S.UPDATE_SQ] for r in table) if sharded else table[0][S.UPDATE_SQ]
        param_norm = math.sqrt(psq) if psq >= 0 else math.nan
        update_ratio = math.sqrt(usq) / param_norm if param_norm and math.isfinite(param_norm) and usq >= 0 else None
    s = StepStats(
        step=step,
        grad_norm=grad_norm if norm_known else math.nan,
        grad_norm_known=norm_known,
        loss=loss_sum / loss_cnt if loss_cnt > 0 else math.nan,
        world_size=len(table),
        max_grad_norm=max_grad_norm,
        clipped=bool(max_grad_norm is not None and math.isfinite(grad_norm) and grad_norm > max_grad_norm),
        lr=lr,
        loss_scale=table[0][S.LOSS_SCALE] if scale_known else None,
        lr_peak=lr_peak,
        lr_scheduled=lr_scheduled,
        param_norm=param_norm,
        update_ratio=update_ratio,
        nonfinite_loss_ranks=nonfinite_loss_ranks,
        nonfinite_input_ranks=nonfinite_input_ranks,
        exception_ranks=exception_ranks,
        rank_loss=rank_loss,
        rank_input_absmax=rank_absmax,
        rank_seconds=rank_seconds,
        timestep_bucket_loss=buckets,
        # the largest FINITE absmax: a rank with non-finite inputs is the nonfinite detector's case
        input_absmax=0.0 if best_absmax is None else best_absmax,
        input_nonfinite=len(nonfinite_input_ranks),
        input_rms=_rms(sum_sq, numel),
    )
    s.overflow = bool(
        has_scaler
        and norm_known
        and not math.isfinite(grad_norm)
        and not (s.nonfinite_loss_ranks or s.nonfinite_input_ranks or s.exception_ranks)
    )
    return s


def bad_input_only(s: StepStats, ignore: Sequence[str]) -> bool:
    """True when the step's only finding is ``nonfinite`` and every rank with a non-finite loss also had
    non-finite inputs: bad data, skipped before it reached the weights, not a sick model (a ``nonfinite``
    SKIP on bad inputs still never applies the step; this only keeps checkpoints healthy)."""
    if not s.findings:
        return False
    loud = [f for f in s.findings if f.verdict >= Verdict.WARN and f.detector not in ignore]
    return (bool(s.nonfinite_input_ranks) and bool(loud) and all(f.detector == "nonfinite" for f in loud)
            and set(s.nonfinite_loss_ranks) <= set(s.nonfinite_input_ranks) and not s.exception_ranks)


def _bucket_means(table: list[list[float]], layout: S.Layout) -> list[float | None]:
    """Mean loss per timestep bucket over ranks (``None`` for an empty bucket). A loop that passes no
    per-sample losses (the attached loop) leaves every count at 0: one look at the counts, no division."""
    cnt_slice = layout.bucket_count
    if len(table) == 1:
        cnts = table[0][cnt_slice]
        if not any(cnts):
            return [None] * layout.buckets
        sums = table[0][layout.bucket_sum]
    else:
        cnts = [sum(col) for col in zip(*(r[cnt_slice] for r in table))]
        if not any(cnts):
            return [None] * layout.buckets
        sums = [sum(col) for col in zip(*(r[layout.bucket_sum] for r in table))]
    return [x / c if c > 0 else None for x, c in zip(sums, cnts)]


def _rms(sum_sq: float, count: float) -> float | None:
    return math.sqrt(sum_sq / count) if count > 0 else None
