"""Sliding windows whose statistics cost O(log n) or O(1) per step instead of a pass over the window.

The detectors judge every optimizer step, and several of them judge a window of recent values *as if this
step's value were already in it* (``observe`` must not change their state; ``update`` adds it once the
verdict is final). These windows answer both questions without copying the window:

* :class:`SortedWindow`: the last ``size`` values, also kept sorted (``bisect``), for medians and counts
  above a threshold: what ``statistics.median`` / ``median_low`` of the window would return, bit for bit.
* :class:`SlopeWindow`: the last ``size`` values with running sums of ``y``, ``i * y`` and the number of
  rises between neighbours, for the least-squares slope over ``i = 0 .. n-1`` (equal to the two-pass
  formula within float rounding; the sums are recomputed from the values every ``RESYNC`` pushes, so the
  rounding of a long run never accumulates).

Values must be ordered floats (no NaN); the detectors only add finite values.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from typing import Iterable


class SortedWindow:
    """The last ``size`` values in arrival order (:attr:`values`) and the same values sorted."""

    def __init__(self, size: int, values: Iterable[float] = ()) -> None:
        self.size = int(size)
        self.values: deque[float] = deque(maxlen=self.size)
        self._sorted: list[float] = []
        for v in values:
            self.push(v)

    def __len__(self) -> int:
        return len(self.values)

    @property
    def full(self) -> bool:
        return len(self.values) == self.size

    def push(self, x: float) -> None:
        """Add ``x``; the oldest value leaves a full window."""
        if len(self.values) == self.size:
            del self._sorted[bisect_left(self._sorted, self.values[0])]
        self.values.append(x)
        insort(self._sorted, x)

    def clear(self) -> None:
        self.values.clear()
        self._sorted.clear()

    def kth(self, k: int) -> float:
        """The ``k``-th smallest value (0-based)."""
        return self._sorted[k]

    def kth_pushed(self, x: float, k: int) -> float:
        """The ``k``-th smallest value of the window as :meth:`push` ``(x)`` would leave it (nothing changes)."""
        s = self._sorted
        q = bisect_left(s, x)  # values < x
        if len(self.values) < self.size:  # nothing leaves: x slots in at q
            return s[k] if k < q else x if k == q else s[k - 1]
        i = bisect_left(s, self.values[0])  # the leaving value's place
        p = q - 1 if q > i else q  # x's place once it left
        if k == p:
            return x
        j = k if k < p else k - 1  # index among the values that stay
        return s[j] if j < i else s[j + 1]

    def pushed_len(self) -> int:
        """The window's length after a :meth:`push`."""
        return min(len(self.values) + 1, self.size)

    def median(self) -> float:
        """``statistics.median`` of the window (not empty)."""
        n = len(self._sorted)
        return self._sorted[n // 2] if n % 2 else (self._sorted[n // 2 - 1] + self._sorted[n // 2]) / 2

    def median_pushed(self, x: float) -> float:
        """``statistics.median`` of the window as :meth:`push` ``(x)`` would leave it."""
        n = self.pushed_len()
        if n % 2:
            return self.kth_pushed(x, n // 2)
        return (self.kth_pushed(x, n // 2 - 1) + self.kth_pushed(x, n // 2)) / 2

    def median_low_pushed(self, x: float) -> float:
        """``statistics.median_low`` of the window as :meth:`push` ``(x)`` would leave it."""
        return self.kth_pushed(x, (self.pushed_len() - 1) // 2)

    def count_above(self, threshold: float) -> int:
        """How many values are ``> threshold``."""
        return len(self._sorted) - bisect_right(self._sorted, threshold)

    def count_above_pushed(self, x: float, threshold: float) -> int:
        """:meth:`count_above` of the window as :meth:`push` ``(x)`` would leave it."""
        n = self.count_above(threshold) + (x > threshold)
        if len(self.values) == self.size:
            n -= self.values[0] > threshold
        return n


def median_without(sorted_values: list[float], i: int) -> float:
    """``statistics.median`` of ``sorted_values`` without the value at index ``i`` (at least 2 values)."""
    n = len(sorted_values) - 1

    def at(k: int) -> float:
        return sorted_values[k] if k < i else sorted_values[k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class SlopeWindow:
    """The last ``size`` values ``y_0 .. y_{n-1}`` (oldest first) with running ``sum(y)``, ``sum(i * y)`` and
    the number of rises ``y_{i+1} > y_i``: the least-squares slope of ``y`` over ``i`` in O(1)."""

    RESYNC = 1024
    """Pushes between exact recomputations of the running sums from the values (bounds float drift)."""

    def __init__(self, size: int, values: Iterable[float] = ()) -> None:
        self.size = int(size)
        self.values: deque[float] = deque(maxlen=self.size)
        self.values.extend(values)
        self._resync()

    def __len__(self) -> int:
        return len(self.values)

    def _resync(self) -> None:
        v = self.values
        self.sum_y = math.fsum(v)
        self.sum_iy = math.fsum(i * y for i, y in enumerate(v))
        self.rises = sum(b > a for a, b in zip(v, list(v)[1:]))
        self._pushes = 0

    def clear(self) -> None:
        self.values.clear()
        self._resync()

    def pushed(self, y: float) -> tuple[int, float, float, int]:
        """``(n, sum(y), sum(i * y), rises)`` of the window as :meth:`push` ``(y)`` would leave it."""
        v = self.values
        sy, siy, rises, n = self.sum_y, self.sum_iy, self.rises, len(v)
        if n == self.size:  # the oldest leaves, every index moves down by one
            old = v[0]
            sy -= old
            siy -= sy
            if n > 1:
                rises -= v[1] > old
            n -= 1
        if n:  # a value stays before y
            rises += y > v[-1]
        return n + 1, sy + y, siy + n * y, rises

    def push(self, y: float) -> None:
        """Add ``y``; the oldest value leaves a full window."""
        n, self.sum_y, self.sum_iy, self.rises = self.pushed(y)
        self.values.append(y)
        self._pushes += 1
        if self._pushes >= self.RESYNC:
            self._resync()


def slope(n: int, sum_y: float, sum_iy: float) -> float:
    """Least-squares slope of ``y`` over ``i = 0 .. n-1`` from ``sum(y)`` and ``sum(i * y)`` (``n >= 2``):
    ``sum((i - m) * y) / sum((i - m)^2)`` with ``m = (n - 1) / 2`` and ``sum((i - m)^2) = n (n^2 - 1) / 12``."""
    return (sum_iy - (n - 1) / 2 * sum_y) / (n * (n * n - 1) / 12)


class CountWindow:
    """The last ``size`` booleans and how many of them are true (e.g. clipped steps): the rate in O(1)."""

    def __init__(self, size: int, values: Iterable[bool] = ()) -> None:
        self.values: deque[bool] = deque(maxlen=max(int(size), 1))
        self.count = 0
        for v in values:
            self.push(v)

    def __len__(self) -> int:
        return len(self.values)

    def push(self, flag: bool) -> None:
        """Add ``flag``; the oldest leaves a full window."""
        flag = bool(flag)
        if len(self.values) == self.values.maxlen:
            self.count -= self.values[0]
        self.values.append(flag)
        self.count += flag

    def rate(self) -> float:
        """The fraction of true values (0.0 for an empty window)."""
        return self.count / len(self.values) if self.values else 0.0
