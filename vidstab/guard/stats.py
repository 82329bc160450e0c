"""The one producer of a step's statistics: the reduced summary (and, on a step that shows something, every
rank's vector) read into one :class:`~vidstab.detectors.StepStats`, the same on every rank. Every consumer --
detectors, metrics lines, incident bundles, replay, benchmarks -- reads a step's statistics from here."""

from __future__ import annotations

import math
from typing import Sequence

from .. import signals as S
from ..detectors import StepStats, Verdict
from ..detectors.running import MIXED_BUCKET


def anomalous(summary: Sequence[float], layout: S.Layout) -> bool:
    """Whether the summary shows a rank with a non-finite value, an exception or an out-of-memory, or a non-finite
    norm: every rank's vector is then gathered to name them (the same answer on every rank)."""
    L = layout
    return bool(summary[L.ranks_loss_bad] or summary[L.ranks_input_bad] or summary[L.ranks_exception]
                or summary[L.norm_nonfinite] or _oom(summary, L) or _oom_in_step(summary, L) is not None)


def build_stats(
    step: int,
    summary: Sequence[float],
    layout: S.Layout,
    *,
    rows: Sequence[Sequence[float]] | None = None,
    bucket: str = "default",
    max_grad_norm: float | None,
    sharded: bool,
    scale_known: bool,
    has_scaler: bool,
) -> StepStats:
    """The statistics of one step.

    ``summary``: the reduced vector (:func:`vidstab.signals.reduce_and_read`). ``rows``: every rank's own vector,
    when gathered (:func:`vidstab.signals.gather_rows`): the per-rank fields come from them. ``bucket``: this
    rank's name for the window's shape bucket (the summary says whether every rank had it). ``sharded``: FSDP,
    parameter sums of squares add up over ranks. ``scale_known``: a GradScaler scale is in the vectors.
    ``has_scaler``: a non-finite norm with finite losses and inputs is an fp16 overflow. The LR figures are the
    largest any rank had (:class:`vidstab.recovery.lr.LRMultiplier` gives each rank's)."""
    L, x = layout, summary
    norm_known = x[L.norm_known] > 0
    grad_norm = math.nan if x[L.norm_nan] or not norm_known else math.inf if x[L.norm_nonfinite] else x[L.grad_norm]
    world = int(x[L.ranks])
    param_norm = update_ratio = None
    if x[L.param_measured] > 0:
        psq, usq = (x[L.param_sq_sum], x[L.update_sq_sum]) if sharded else (x[L.param_sq_max], x[L.update_sq_max])
        param_norm = math.sqrt(psq) if psq >= 0 else math.nan
        update_ratio = math.sqrt(usq) / param_norm if param_norm and math.isfinite(param_norm) and usq >= 0 else None
    slowest = S.decode_slowest(x[L.slowest])
    s = StepStats(
        step=step,
        grad_norm=grad_norm,
        grad_norm_known=norm_known,
        loss=x[L.loss_sum] / x[L.loss_count] if x[L.loss_count] > 0 else math.nan,
        world_size=world,
        max_grad_norm=max_grad_norm,
        clipped=bool(max_grad_norm is not None and math.isfinite(grad_norm) and grad_norm > max_grad_norm),
        lr=_known(x[L.lr]),
        lr_peak=_known(x[L.lr_peak]),
        lr_scheduled=_known(x[L.lr_scheduled]),
        batch_fp=f"{int(x[L.batch_crc]) % (1 << 32):08x}" if x[L.batch_crc_ranks] > 0 else None,
        loss_scale=x[L.loss_scale] if scale_known else None,
        param_norm=param_norm,
        update_ratio=update_ratio,
        timestep_bucket_loss=[sm / c if c > 0 else None for sm, c in zip(x[L.bucket_sum], x[L.bucket_count])],
        input_absmax=x[L.in_absmax],  # the largest FINITE absmax: non-finite inputs are the nonfinite detector's
        input_nonfinite=int(x[L.ranks_input_bad]),
        input_rms=math.sqrt(x[L.in_sumsq] / x[L.in_numel]) if x[L.in_numel] > 0 else None,
        slowest_rank=slowest[0] if slowest else None,
        slowest_seconds=slowest[1] if slowest else None,
        seconds_sum=x[L.seconds],
        bucket=bucket if x[L.bucket] == -x[L.neg_bucket] else MIXED_BUCKET,
    )
    if rows is not None:
        s.nonfinite_loss_ranks = [r for r, v in enumerate(rows) if v[L.ranks_loss_bad] > 0]
        s.nonfinite_input_ranks = [r for r, v in enumerate(rows) if v[L.ranks_input_bad] > 0]
        s.exception_ranks = [r for r, v in enumerate(rows) if v[L.ranks_exception] > 0]
        s.oom_ranks = [r for r, v in enumerate(rows) if _oom(v, L)]
        s.oom_micro_batch = int(x[L.oom]) if s.oom_ranks else None
        s.optimizer_oom_ranks = [r for r, v in enumerate(rows) if len(v) > L.oom_in_step and v[L.oom_in_step] > 0]
        s.first_bad_rank = min(s.nonfinite_loss_ranks + s.nonfinite_input_ranks + s.exception_ranks + s.oom_ranks,
                               default=None)
        s.rank_loss = [v[L.loss_sum] / v[L.loss_count] if v[L.loss_count] > 0 else math.nan for v in rows]
        s.rank_input_absmax = [math.nan if v[L.ranks_input_bad] > 0 else v[L.in_absmax] if v[L.in_numel] > 0 else 0.0
                               for v in rows]
        s.rank_seconds = [v[L.seconds] if S.decode_slowest(v[L.slowest]) else -1.0 for v in rows]
    s.optimizer_oom = _oom_in_step(x, L)
    s.overflow = bool(has_scaler and norm_known and not math.isfinite(grad_norm)
                      and not (x[L.ranks_loss_bad] or x[L.ranks_input_bad] or x[L.ranks_exception] or _oom(x, L)))
    return s


def _oom(x: Sequence[float], layout: S.Layout) -> bool:
    """The out-of-memory column (a vector recorded before it existed is one shorter: none)."""
    return len(x) > layout.oom and x[layout.oom] > 0


def _oom_in_step(x: Sequence[float], layout: S.Layout) -> str | None:
    """:attr:`StepStats.optimizer_oom` from the maximum and the negated minimum of the ranks' codes (1: the
    optimizer step ran out of memory untouched, 2: touched; a vector recorded before the columns existed: none)."""
    if len(x) <= layout.neg_oom_in_step or x[layout.oom_in_step] <= 0:
        return None
    if x[layout.oom_in_step] >= 2:
        return "touched"
    return "skipped" if -x[layout.neg_oom_in_step] >= 1 else "partial"


def _known(v: float) -> float | None:
    """An LR column: ``-1`` (no rank knew it) is None."""
    return None if v < 0 else v


def bad_input_only(s: StepStats, ignore: Sequence[str]) -> bool:
    """True when the step's only finding is ``nonfinite`` and every rank with a non-finite loss also had
    non-finite inputs: bad data, skipped before it reached the weights, not a sick model (a ``nonfinite``
    SKIP on bad inputs still never applies the step; this only keeps checkpoints healthy)."""
    if not s.findings:
        return False
    loud = [f for f in s.findings if f.verdict >= Verdict.WARN and f.detector not in ignore]
    return (bool(s.nonfinite_input_ranks) and bool(loud) and all(f.detector == "nonfinite" for f in loud)
            and set(s.nonfinite_loss_ranks) <= set(s.nonfinite_input_ranks) and not s.exception_ranks)
