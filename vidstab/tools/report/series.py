"""One metric as one series over steps: ranks combined, attempts resolved, long runs binned."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .load import RunLog, _num


#: Points per plotted line; longer series are binned (mean line + min/max envelope).
MAX_POINTS = 2000

# (attempt, step) packed into one int64 key for numpy group-by: steps stay below 2**40.
_KEY = 1 << 40


@dataclass


class Series:
    """One metric over steps: the final trajectory, plus values superseded by a later attempt."""

    steps: np.ndarray
    """Steps of the final trajectory (sorted, unique)."""
    values: np.ndarray
    """Values at those steps."""
    superseded: list[tuple[np.ndarray, np.ndarray]]
    """(steps, values) of each earlier attempt over steps that were run again later."""

    @property
    def empty(self) -> bool:
        """True when no finite value exists."""
        return not np.isfinite(self.values).any()


def _merge(log: RunLog, name: str, ranks: Iterable[int] | None = None, how: str = "mean") -> Series:
    """A metric as one series over steps: ranks combined (``mean`` for rank-local numbers, ``first`` for
    global ones), attempts resolved (the latest attempt of a step wins; earlier ones go to ``superseded``)."""
    parts_s, parts_a, parts_v, parts_r = [], [], [], []
    for rank, m in log.metrics.items():
        if ranks is not None and rank not in ranks:
            continue
        if name not in m.columns:
            continue
        parts_s.append(m.steps)
        parts_a.append(m.attempts)
        parts_v.append(m.columns[name])
        parts_r.append(np.full(len(m.steps), rank))
    if not parts_s:
        return Series(np.array([]), np.array([]), [])
    steps = np.concatenate(parts_s)
    attempts = np.concatenate(parts_a)
    values = np.concatenate(parts_v)
    rank_of = np.concatenate(parts_r)
    if how == "first":  # global numbers: the lowest rank that logged a finite value
        order = np.lexsort((rank_of, ~np.isfinite(values), steps, attempts))
        steps, attempts, values = steps[order], attempts[order], values[order]
        keys = attempts.astype(np.int64) * _KEY + steps.astype(np.int64)
        _, first = np.unique(keys, return_index=True)
        steps, attempts, values = steps[first], attempts[first], values[first]
    else:
        keys = attempts.astype(np.int64) * _KEY + steps.astype(np.int64)
        uniq, inverse = np.unique(keys, return_inverse=True)
        finite = np.isfinite(values)
        sums = np.zeros(len(uniq))
        counts = np.zeros(len(uniq))
        anybad = np.zeros(len(uniq), dtype=bool)
        np.add.at(sums, inverse[finite], values[finite])
        np.add.at(counts, inverse[finite], 1)
        np.logical_or.at(anybad, inverse, ~finite)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = sums / counts
        steps = (uniq % _KEY).astype(np.int64)
        attempts = (uniq // _KEY).astype(np.int64)
    # Final trajectory: for each step the value of its latest attempt.
    order = np.lexsort((attempts, steps))
    steps, attempts, values = steps[order], attempts[order], values[order]
    last = np.r_[steps[1:] != steps[:-1], True]
    superseded = []
    for a in np.unique(attempts[~last]):
        sel = (~last) & (attempts == a)
        superseded.append((steps[sel], values[sel]))
    return Series(steps[last], values[last], superseded)


def _nonfinite_loss_steps(log: RunLog) -> np.ndarray:
    """Steps with a non-finite loss on any rank, in the final attempt or not: the loss logged non-finite
    (``"nan"``/``"inf"``, or ``null`` in an old log), or a
    ``nonfinite`` finding about the loss. The second matters under gradient accumulation: the step's loss
    is the mean of its finite micro-batch losses, so one NaN micro-batch leaves the logged loss finite
    (vidstab/detectors/nonfinite.py says "non-finite loss on rank(s) ...")."""
    out = [m.steps[m.nonfinite["loss"]] for m in log.metrics.values() if "loss" in m.nonfinite]
    out.append(np.array([int(_num(e.get("step"))) for e in log.events
                         if e.get("detector") == "nonfinite" and "non-finite loss" in str(e.get("message"))],
                        dtype=np.int64))
    return np.unique(np.concatenate(out)).astype(np.int64)


def _loss_by_t(log: RunLog) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, [n_steps, n_buckets])``: bucket losses, mean over ranks, latest attempt per step."""
    parts = [(m.steps, m.attempts, m.loss_by_t) for m in log.metrics.values() if m.loss_by_t.size]
    if not parts:
        return np.array([]), np.zeros((0, 0))
    width = max(p[2].shape[1] for p in parts)
    steps = np.concatenate([p[0] for p in parts])
    attempts = np.concatenate([p[1] for p in parts])
    table = np.concatenate([np.pad(p[2], ((0, 0), (0, width - p[2].shape[1])), constant_values=np.nan) for p in parts])
    keys = attempts.astype(np.int64) * _KEY + steps.astype(np.int64)
    uniq, inverse = np.unique(keys, return_inverse=True)
    finite = np.isfinite(table)
    sums = np.zeros((len(uniq), width))
    counts = np.zeros((len(uniq), width))
    np.add.at(sums, inverse, np.where(finite, table, 0.0))
    np.add.at(counts, inverse, finite)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts  # nan where a bucket had no sample on any rank
    steps, attempts = uniq % _KEY, uniq // _KEY
    order = np.lexsort((attempts, steps))
    steps, means = steps[order], means[order]
    last = np.r_[steps[1:] != steps[:-1], True]
    return steps[last], means[last]


class _quiet:
    """Silence numpy's 'mean of empty slice' warnings (an empty bucket is normal)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _bin(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS):
    """``(x, mean, low, high)``: series longer than ``max_points`` binned to ``max_points // 2`` bins
    (``low``/``high`` are the bin min/max, ``None`` when not binned)."""
    if len(x) <= max_points:
        return x, y, None, None
    n_bins = max_points // 2
    edges = np.linspace(0, len(x), n_bins + 1).astype(int)
    xs, mean, low, high = [], [], [], []
    with _quiet():
        for a, b in zip(edges[:-1], edges[1:]):
            if b <= a:
                continue
            seg = y[a:b]
            xs.append(x[a:b].mean())
            mean.append(np.nanmean(seg))
            low.append(np.nanmin(seg))
            high.append(np.nanmax(seg))
    return np.array(xs), np.array(mean), np.array(low), np.array(high)
