"""A rank persistently slower than the others -> WARN naming the rank and by how much.

One slow GPU (thermal throttling, a bad link, a noisy neighbour) or one slow data loader drags every
step of a synchronous job: the other ranks wait for it in the gradient all-reduce. Each rank measures its
own compute time up to the first collective of the step (``vidstab.signals.StepClock``), so waiting for the
straggler is not in the others' time. The guard's per-step reduction carries the slowest rank, its time and
the sum of all ranks' times (``StepStats.slowest_rank``, ``slowest_seconds``, ``seconds_sum``): a fixed-size
summary, whatever the number of ranks, with no extra collective.

Robust to ordinary jitter: a step is slow for rank ``r`` when ``r`` is the slowest rank and at least ``ratio``
times AND ``min_seconds`` slower than the mean of the others; a warning needs ``patience`` such steps in a row
for the same rank (a jittery rank is the slowest now and then, a straggler every time). The same straggler is not reported again for ``quiet_steps``
steps. The idea follows NVIDIA's resiliency extension (straggler detection by relative per-rank performance
scores, https://github.com/NVIDIA/nvidia-resiliency-ext), without its CUPTI kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, check


@dataclass
class StragglerConfig(DetectorConfig):
    """Configuration of the ``straggler`` detector (watches per-rank compute times; needs 2 or more ranks)."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: a slow rank costs time, not correctness."""
    window: int = 20
    """Not used (the straggler is read from each step's summary: ``patience`` slow steps in a row); kept so that
    configurations written for per-rank medians still load."""
    ratio: float = 1.5
    """A step is slow for the slowest rank when its time is at least this multiple of the others' mean ..."""
    min_seconds: float = 0.002
    """... and at least this many seconds more (tiny steps jitter by whole milliseconds)."""
    patience: int = 10
    """Slow steps of the same rank in a row before a warning (a passing hiccup is not a straggler)."""
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
        self.streak_rank, self.streak = -1, 0  # the rank slow on the last judged steps, and on how many in a row
        self.quiet_until: dict[int, int] = {}
        self.seen = 0

    def _slow_rank(self, s: StepStats) -> tuple[int, float, float]:
        """``(rank, factor, mean of the others)``: the step's slow rank (-1 if none)."""
        r, t = s.slowest_rank, s.slowest_seconds
        if r is None or t is None or s.world_size < 2 or t < 0:
            return -1, 1.0, 0.0
        others = (s.seconds_sum - t) / (s.world_size - 1)
        factor = t / others if others > 0 else float("inf")
        slow = factor >= self.config.ratio and t - others >= self.config.min_seconds
        return (r if slow else -1), factor, others

    def _run_with(self, r: int) -> int:
        """The streak of slow steps of ``r`` with this step in it."""
        return self.streak + 1 if r == self.streak_rank else 1

    def observe(self, s: StepStats) -> Finding | None:
        if self.seen < self.config.warmup_steps:
            return None
        r, factor, others = self._slow_rank(s)
        if r < 0 or s.step < self.quiet_until.get(r, -1):
            return None
        run = self._run_with(r)
        if run < self.config.patience:
            return None
        return self.finding(
            f"rank {r} is a straggler: its own compute time is {factor:.2f}x the other ranks' mean "
            f"({s.slowest_seconds * 1e3:.1f} ms vs {others * 1e3:.1f} ms), the slowest on {run} steps in a row; "
            "every rank waits for it",
            {"rank": float(r), "factor": factor, "rank_seconds": float(s.slowest_seconds), "others_seconds": others},
            [r],
        )

    def update(self, s: StepStats) -> None:
        if s.slowest_rank is None or s.world_size < 2:
            return
        self.seen += 1
        if self.seen <= self.config.warmup_steps:
            return
        r = self._slow_rank(s)[0]
        self.streak_rank, self.streak = (r, self._run_with(r)) if r >= 0 else (-1, 0)
        for f in s.findings:
            if f.detector == self.name:
                for rank in f.ranks:
                    self.quiet_until[rank] = s.step + self.config.quiet_steps

    def state_dict(self) -> dict:
        return {"streak_rank": self.streak_rank, "streak": self.streak,
                "quiet_until": {str(k): v for k, v in self.quiet_until.items()}, "seen": self.seen}

    def load_state_dict(self, d: dict) -> None:
        self.streak_rank, self.streak = int(d.get("streak_rank", -1)), int(d.get("streak", 0))
        quiet = d.get("quiet_until", {})
        self.quiet_until = {int(k): int(v) for k, v in quiet.items()} if isinstance(quiet, dict) else {}
        self.seen = int(d.get("seen", 0))
