"""The checkpoint interval a run's own measurements call for (Young/Daly), from its goodput ledger.

With ``C`` the seconds a save blocks training, ``M`` the mean time between failures and ``R`` what a failure
costs besides the lost work (restart downtime, start-up, hang until the watchdog, rollback), the time between
checkpoints that maximises availability is ``C + sqrt(2 (M + R) C + C^2)``; for ``C, R << M`` it is Young's
``sqrt(2 C M)``. ``M`` is what the run has shown: ``n`` failures (restarts and rollbacks) in ``T`` seconds of
wall time give ``M = T / (n + 1)``, the next failure counted as already due, so an interval never bets on more
failure-free time than the run has survived (``E[T / (n + 1)] = M (1 - exp(-T / M))``: never optimistic, unlike
the one-sample ``T / n``); before the first failure it is also at most the prior, ``expected_mtbf_hours``.
Cost to a long run failing less often than its prior ``P``: about ``sqrt(C P / 2)`` s more save stall, once.
"""

from __future__ import annotations

import math
from typing import Any, Mapping


def optimal_interval_seconds(save_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0) -> float:
    """``C + sqrt(2 (M + R) C + C^2)`` (module docstring)."""
    c, m, r = float(save_seconds), float(mtbf_seconds), float(restart_seconds)
    if c < 0 or m <= 0 or r < 0:
        raise ValueError(f"save {c} s, MTBF {m} s, restart {r} s: need save >= 0, MTBF > 0, restart >= 0")
    return c + math.sqrt(2.0 * (m + r) * c + c * c)


def recommend(led: Mapping[str, Any], expected_mtbf_hours: float = 24.0) -> dict | None:
    """The interval the ledger's measurements call for, with its inputs; None before a save and a kept step
    were measured. ``interval_steps`` converts ``interval_seconds`` at the run's mean productive step time."""
    counts, buckets, steps = led.get("counts") or {}, led["buckets"], led["steps"]
    saves, kept = counts.get("checkpoint", 0), steps.get("productive", 0)
    if not saves or not kept or buckets["productive"] <= 0:
        return None
    failures = led.get("restarts", 0) + counts.get("rollback", 0)
    save = led.get("save_blocking_seconds", buckets["checkpoint"]) / saves
    cost = buckets["restart"] + buckets["hang"] + buckets["rollback"]
    if failures:
        restarted = sum(a["buckets"]["startup"] for a in led["attempts"][1:])
        restart = (cost + restarted) / failures
    else:  # no failure yet: a restart would cost what this run's start-up cost
        restart = led["attempts"][0]["buckets"]["startup"] if led["attempts"] else 0.0
    mtbf, mtbf_from = mtbf_estimate(led["wall_seconds"], failures, expected_mtbf_hours)
    step = buckets["productive"] / kept
    seconds = optimal_interval_seconds(save, mtbf, restart)
    return {"save_seconds": save, "restart_seconds": restart, "mtbf_seconds": mtbf, "mtbf_from": mtbf_from,
            "failures": failures, "wall_seconds": led["wall_seconds"], "step_seconds": step,
            "interval_seconds": seconds, "interval_steps": max(1, round(seconds / step)),
            "expected_mtbf_hours": float(expected_mtbf_hours)}


def mtbf_estimate(wall_seconds: float, failures: int, expected_mtbf_hours: float) -> tuple[float, str]:
    """``M`` (module docstring) and where it came from: ``"failures"`` (``T / (n + 1)``), ``"survived"`` (no
    failure yet: ``T``) or ``"prior"`` (no failure yet, and ``T`` beyond the prior)."""
    survived = max(float(wall_seconds), 1e-3)  # a ledger of no time yet: the smallest bet
    if failures:
        return survived / (failures + 1), "failures"
    prior = 3600.0 * float(expected_mtbf_hours)
    return (survived, "survived") if survived < prior else (prior, "prior")


class AutoInterval:
    """``--checkpointing_steps auto``: the steps between saves, re-chosen from the run's ledger after every save.

    The main process reads the ledger (``goodput``: a :class:`vidstab.run.goodput.GoodputLog`, incremental) and every
    rank takes its answer (``share``: a function sending rank 0's integer to every rank, since a save is
    collective); the interval stays within ``[floor, ceiling]`` steps and every change is logged as a
    ``checkpoint_interval`` event with its inputs and the formula's value.

    ``lead_steps``: how many steps before a failure the detectors fire (``lead_from`` says where the figure comes
    from). A rollback target must be older than that -- a checkpoint taken after the first warning is not healthy,
    one taken just before it is already on the failing trajectory -- so the re-chosen interval is never shorter:
    the floor is ``max(floor, lead_steps)`` (the first save, which measures the stall, comes after ``first``)."""

    def __init__(self, goodput: Any, share: Any, *, first: int, floor: int, ceiling: int,
                 expected_mtbf_hours: float = 24.0, lead_steps: int = 0, lead_from: str | None = None) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"checkpoint interval bounds [{floor}, {ceiling}]: need 1 <= floor <= ceiling")
        if not expected_mtbf_hours > 0:
            raise ValueError(f"expected_mtbf_hours {expected_mtbf_hours}: must be > 0")
        self.goodput, self.share = goodput, share
        self.steps = min(max(int(first), int(floor)), int(ceiling))
        self.lead_steps, self.lead_from, self.floor_configured = max(0, int(lead_steps)), lead_from, int(floor)
        self.floor, self.ceiling, self.expected_mtbf_hours = (min(max(int(floor), self.lead_steps), int(ceiling)),
                                                              int(ceiling), float(expected_mtbf_hours))
        self.last_saved = 0

    def due(self, step: int) -> bool:
        """Whether ``step`` (optimizer steps done) is ``steps`` past the last save (or the start of this process)."""
        if step < self.last_saved:  # rolled back to a checkpoint: that is the last save now
            self.last_saved = step
        return step - self.last_saved >= self.steps

    def saved(self, events: Any, step: int, trajectory: int | None = None) -> int:
        """After a save at ``step`` (the script's, the event's): re-choose the interval (every rank calls it); returns
        it. ``trajectory``: the step :meth:`due` counts, where in-place rollbacks made it differ (the attached form's)."""
        self.last_saved = step if trajectory is None else int(trajectory)
        advice = None
        if self.goodput.main:
            advice = recommend(self.goodput.ledger(), self.expected_mtbf_hours)
        chosen = self.steps if advice is None else min(max(advice["interval_steps"], self.floor), self.ceiling)
        chosen = int(self.share(chosen))
        if chosen != self.steps:
            if advice is not None:
                events.log("checkpoint_interval", step, steps=chosen, previous=self.steps, floor=self.floor,
                           ceiling=self.ceiling, floor_configured=self.floor_configured, lead_steps=self.lead_steps,
                           lead_from=self.lead_from, **advice)
            self.steps = chosen
        return self.steps


def auto_interval(accelerator: Any, run_dir: Any, *, first: int = 10, floor: int = 10, ceiling: int = 10_000,
                  expected_mtbf_hours: float = 24.0, guard_config: Any = None) -> AutoInterval:
    """An :class:`AutoInterval` over the run's ledger, rank 0's answer broadcast to every rank. ``guard_config``
    (:class:`vidstab.GuardConfig`): the detectors' lead time is its ``health_window``, the steps before a failure
    in which a warning makes a checkpoint no rollback target (:func:`lead_steps`)."""
    import torch
    from accelerate.utils import broadcast

    from .goodput import GoodputLog

    def share(steps: int) -> int:
        if getattr(accelerator, "num_processes", 1) <= 1:
            return steps
        return int(broadcast(torch.tensor([steps], device=accelerator.device), from_process=0).item())

    return AutoInterval(GoodputLog(accelerator, run_dir, every=0), share, first=first, floor=floor, ceiling=ceiling,
                        expected_mtbf_hours=expected_mtbf_hours, lead_steps=lead_steps(guard_config),
                        lead_from=None if guard_config is None else "health_window")


def lead_steps(guard_config: Any) -> int:
    """The detectors' lead time in steps, from the guard's configured windows: its ``health_window``, the span
    before a failure within which the slow detectors' warnings (LR jump, update ratio, growth, trend) mark a
    checkpoint as no rollback target. 0 without a guard configuration, or with the guard off."""
    if guard_config is None or not getattr(guard_config, "enabled", True):
        return 0
    return max(0, int(getattr(guard_config, "health_window", 0) or 0))
