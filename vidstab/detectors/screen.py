"""The healthy-step screen: every detector's promise about the next step, checked with a few comparisons.

After a detector absorbs a step, it says (:meth:`~vidstab.detectors.Detector.quiet_bounds`) on which values of
which :class:`~vidstab.detectors.StepStats` fields its next ``observe`` is certain to find nothing:
``grad_spike`` below its threshold line, ``loss_spike`` below its own, ``input_scale`` inside its warn band
and its CUSUM's reach, ``clip_rate`` whenever the window cannot reach its rate. The promise is taken right
after the detector's ``update``, while its state is still in the CPU's caches. On the next step
:func:`vidstab.detectors.judge` compares the step's values with the promises (one or two comparisons per
detector) and calls ``observe`` only where a value breaks one, or where there is none. A promise is exact:
the detector judges anything within rounding of its line itself, so findings, verdicts and detector states
are those of calling every detector (``tests/test_detector_screen.py`` compares both, step by step).

A promise holds for one step: the screen is used only for the step right after the one it was taken on, and
:meth:`Screen.clear` drops it when the detectors' state is replaced (a rollback's ``load_state_dict``).
"""

from __future__ import annotations

from typing import Any, Sequence

_NOTHING: frozenset[int] = frozenset()


class Screen:
    """The promises of the detectors that make them, for one step (module docstring).

    ``slots`` holds, per promising detector, its index among the plan's observers; ``bounds[k]`` is that
    detector's latest promise (``None``: none), written by :func:`vidstab.detectors.absorb`."""

    def __init__(self, slots: Sequence[int] = ()) -> None:
        self.slots = tuple(slots)
        self.clear()

    def clear(self) -> None:
        """No promise: every detector is called on the next step."""
        self.step: int | None = None  # the step the promises are about
        self.bounds: list[Any] = [None] * len(self.slots)

    def quiet(self, stats: Any) -> "frozenset[int] | set[int]":
        """The observer indices whose ``observe`` is certain to find nothing on ``stats``."""
        if stats.step != self.step:
            return _NOTHING
        out = set()
        for slot, bounds in zip(self.slots, self.bounds):
            if bounds is None:
                continue
            for f, lo, hi in bounds:
                v = getattr(stats, f)
                if v is None or not lo <= v <= hi:  # NaN breaks every promise
                    break
            else:
                out.add(slot)
        return out
