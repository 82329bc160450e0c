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

Updates made later (a plan built with ``defer=True``, the guard's). A promise that covers several updates and is
*steady* (:attr:`~vidstab.detectors.Detector.promise_steady`: the update of a step without findings inside its
bounds cannot break it) is the same after such an update as before it. So on a step without findings that the
screen let through, :func:`vidstab.detectors.absorb` only queues the step for that detector (:attr:`Screen.pending`)
and the update is made later, with the others queued: right after a training step the CPU caches are cold, and
one loop over several updates pays for them once. The queue never outlives the promise (at most its updates) and is
emptied, in step order, before anything reads the detector: its ``observe`` (a step outside the promise),
``state_dict``/``load_state_dict``, an event-log flush, ``Guard.detectors`` (:func:`vidstab.detectors.catch_up`);
a step whose line a tracker takes at once queues nothing (``absorb(..., defer=False)``). Findings, verdicts, states and the published thresholds are those of
updating every step (``tests/test_detector_screen.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

_NOTHING: frozenset[int] = frozenset()


class Screen:
    """The promises of the detectors that make them, for one step (module docstring).

    ``slots`` holds, per promising detector, its index among the plan's observers; ``bounds[k]`` is that
    detector's latest promise (``None``: none), written by :func:`vidstab.detectors.absorb`."""

    def __init__(self, slots: Sequence[int] = (), defer: bool = False) -> None:
        self.slots = tuple(slots)
        self.defer = defer
        """Whether :func:`vidstab.detectors.absorb` may queue steady detectors' updates (module docstring)."""
        self.clear()

    def clear(self) -> None:
        """No promise: every detector is called on the next step. Queued updates are dropped: catch the
        detectors up first (:func:`vidstab.detectors.catch_up`) unless their state is being replaced."""
        self.step: int | None = None  # the step the promises are about
        self.bounds: list[Any] = [None] * len(self.slots)
        self.pending: list[list[list[Any]]] = [[] for _ in self.slots]
        """Per slot, the ``[stats, metrics record or None]`` of the steps whose update waits, oldest first."""
        self.judged: Any = None  # the stats the last quiet() was asked about, and its answer (for absorb)
        self.judged_quiet: "frozenset[int] | set[int]" = _NOTHING

    def quiet(self, stats: Any) -> "frozenset[int] | set[int]":
        """The observer indices whose ``observe`` is certain to find nothing on ``stats``."""
        self.judged, self.judged_quiet = stats, _NOTHING
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
        if self.defer:
            self.judged_quiet = out
        return out
