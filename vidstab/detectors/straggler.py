"""A rank persistently slower than the others -> WARN naming the rank and by how much.

One slow GPU (thermal throttling, a bad link, a noisy neighbour) or one slow data loader drags every
step of a synchronous job: the other ranks wait for it in the gradient all-reduce. The guard already
gathers one row per rank per step; each row carries that rank's own compute time (``StepStats.rank_seconds``,
measured up to the first collective of the step, so waiting for the straggler is not in the others' time:
``vidstab.signals.StepClock``). No extra collective, no extra sync.

Robust to ordinary jitter: a rank's time is the median of its last ``window`` steps, compared with the
median of the other ranks' medians; it must be ``ratio`` times slower AND ``min_seconds`` slower, on
``patience`` consecutive steps, before a warning. The same straggler is not reported again for
``quiet_steps`` steps. The idea follows NVIDIA's resiliency extension (straggler detection by relative
per-rank performance scores, https://github.com/NVIDIA/nvidia-resiliency-ext), without its CUPTI kernels.

Its promise (:meth:`StragglerDetector.promise`) counts steps, not times: no warning can come before some rank has
been slow ``patience`` steps in a row, so while every streak is short the guard may apply healthy steps of a run
of several processes at once and hand the straggler their times later (``vidstab/guard/healthy.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, check
from .windows import SortedWindow, median_without


@dataclass
class StragglerConfig(DetectorConfig):
    """Configuration of the ``straggler`` detector (watches per-rank compute times; needs 2 or more ranks)."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: a slow rank costs time, not correctness."""
    window: int = 20
    """Steps in each rank's median."""
    ratio: float = 1.5
    """A rank is slow when its median is at least this multiple of the other ranks' median ..."""
    min_seconds: float = 0.002
    """... and at least this many seconds more (tiny steps jitter by whole milliseconds)."""
    patience: int = 10
    """Consecutive slow steps before a warning (a passing hiccup is not a straggler)."""
    warmup_steps: int = 5
    """Steps ignored at the start (first-step compilation and cache warm-up differ between ranks)."""
    quiet_steps: int = 500
    """Steps without a new warning about the same rank after one."""

    def validate_fields(self, prefix: str) -> None:
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(self.min_seconds >= 0, f"{prefix}.min_seconds", "must be >= 0", self.min_seconds)
        check(self.patience >= 1, f"{prefix}.patience", "must be >= 1", self.patience)
        check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0", self.warmup_steps)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class StragglerDetector(Detector):
    """Per-rank medians of the own compute time; see the module docstring."""

    name = "straggler"
    min_world_size = 2  # one process has no other rank to be slower than

    def __init__(self, config: StragglerConfig) -> None:
        super().__init__(config)
        self.times: list[SortedWindow] = []  # per rank: its own compute times of the last ``window`` steps
        self.streak: list[int] = []
        self.quiet_until: list[int] = []
        self.seen = 0
        self._slow: tuple[int, list[bool]] | None = None  # (step, per-rank slow now), from observe to update

    def _resize(self, world: int) -> None:
        if len(self.times) != world:
            self.times = [SortedWindow(self.config.window) for _ in range(world)]
            self.streak, self.quiet_until = [0] * world, [-1] * world

    def _medians(self, s: StepStats) -> list[float] | None:
        """Per rank: the median of its window with this step's time in it (``None`` until every window is full)."""
        medians = []
        size = self.config.window
        for r, t in enumerate(s.rank_seconds):
            window = self.times[r]
            if t >= 0:
                if window.pushed_len() < size:
                    return None
                medians.append(window.median_pushed(t))
            else:
                if len(window) < size:
                    return None
                medians.append(window.median())
        return medians

    @staticmethod
    def _others(medians: list[float]) -> list[float]:
        """Per rank: the median of the other ranks' medians."""
        ranked = sorted(medians)
        return [median_without(ranked, bisect_left(ranked, m)) for m in medians]

    def _is_slow(self, m: float, others: float) -> bool:
        factor = m / others if others > 0 else float("inf")
        return factor >= self.config.ratio and m - others >= self.config.min_seconds

    def observe(self, s: StepStats) -> Finding | None:
        world = len(s.rank_seconds)
        self._slow = None
        if world < 2 or self.seen < self.config.warmup_steps:
            return None
        self._resize(world)
        medians = self._medians(s)
        if medians is None:
            return None
        slow, worst = [], None
        for r, (m, others) in enumerate(zip(medians, self._others(medians))):
            is_slow = self._is_slow(m, others)
            slow.append(is_slow)
            due = self.streak[r] + 1 >= self.config.patience and s.step >= self.quiet_until[r]
            if is_slow and due:
                factor = m / others if others > 0 else float("inf")
                if worst is None or factor > worst[1]:
                    worst = (r, factor, m, others)
        self._slow = (s.step, slow)
        if worst is None:
            return None
        r, factor, m, others = worst
        return self.finding(
            f"rank {r} is a straggler: its own compute time is {factor:.2f}x the other ranks' "
            f"(median {m * 1e3:.1f} ms vs {others * 1e3:.1f} ms over {self.config.window} steps, "
            f"{self.streak[r] + 1} steps in a row); every rank waits for it",
            {"rank": float(r), "factor": factor, "rank_seconds": m, "others_seconds": others},
            [r],
        )

    def _slow_now(self, s: StepStats, world: int) -> list[bool]:
        """Per rank, whether it is slow on this step: what :meth:`observe` found, or, on a step the screen did not
        judge (the promise below), the same test made here, on the windows before this step's times go in."""
        if self._slow is not None and self._slow[0] == s.step:
            return self._slow[1]
        medians = self._medians(s)
        if medians is None:
            return [False] * world
        return [self._is_slow(m, others) for m, others in zip(medians, self._others(medians))]

    def update(self, s: StepStats) -> None:
        world = len(s.rank_seconds)
        if world < 2:
            return
        self.seen += 1
        if self.seen <= self.config.warmup_steps:
            return
        self._resize(world)
        slow = self._slow_now(s, world)
        reported = {r for f in s.findings if f.detector == self.name for r in f.ranks}
        for r, t in enumerate(s.rank_seconds):
            if t >= 0:
                self.times[r].push(t)
            self.streak[r] = self.streak[r] + 1 if slow[r] else 0
            if r in reported:
                self.quiet_until[r] = s.step + self.config.quiet_steps

    def promise(self) -> tuple[tuple | None, int]:
        """Quiet, whatever the times, for as many steps as no rank's streak of slow steps can reach ``patience``
        in: a streak grows by at most one per step, and a warning needs ``patience`` in a row. Steady: a step
        without a finding only moves the streaks as counted. So on a healthy run of several processes the
        straggler does not keep the guard from clearing steps at once (``vidstab/guard/healthy.py``); the
        medians are then taken in :meth:`update`, with the step's times, as ``observe`` would have."""
        self.promise_steady = True
        left = self.config.patience - 1 - max(self.streak, default=0)
        return ((), left) if left >= 1 else (None, 1)

    def state_dict(self) -> dict:
        return {"times": [list(t.values) for t in self.times], "streak": list(self.streak),
                "quiet_until": list(self.quiet_until), "seen": self.seen}

    def load_state_dict(self, d: dict) -> None:
        self.times = [SortedWindow(self.config.window, (float(x) for x in t)) for t in d.get("times", [])]
        self.streak = [int(x) for x in d.get("streak", [0] * len(self.times))]
        self.quiet_until = [int(x) for x in d.get("quiet_until", [-1] * len(self.times))]
        self.seen = int(d.get("seen", 0))
        self.break_promise()  # the streaks it counted on were replaced
