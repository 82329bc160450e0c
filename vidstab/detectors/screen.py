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

Whole steps made later (the guard's batched healthy steps, ``vidstab/guard/healthy.py``). :meth:`Screen.admits`
clears a step before its statistics are even built: every detector that would be called holds a steady promise
that covers the updates not made yet and whose bounds the step's values (:data:`SCREEN_FIELDS`, which the guard
reads off its row) lie in, and the detectors without one (``finite_quiet`` aside) would not be called. Such
steps are absorbed several at once, detector by detector (:func:`vidstab.detectors.absorb_batch`), and every
promise is then renewed together (:func:`vidstab.detectors.renew_promises`), so that the next batch is as long
as the promises allow.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

_NOTHING: frozenset[int] = frozenset()
_ABSENT = (None, [])  # what a field a detector needs holds on a step without it (as vidstab.detectors.judge)

#: The :class:`~vidstab.detectors.StepStats` fields :meth:`Screen.admits` reads, in the order of the values it is
#: given: what the promises bound, and the fields whose absence keeps the other detectors from being called at all.
SCREEN_FIELDS = ("grad_norm", "loss", "max_grad_norm", "lr", "lr_to_peak", "lr_to_scheduled", "lr_unplaced",
                 "input_absmax", "input_rms", "timestep_buckets_filled", "param_norm", "update_ratio", "update_per_lr",
                 "loss_scale",
                 "exception_ranks", "findings", "nonfinite_loss_ranks", "nonfinite_input_ranks")
FIELD_INDEX = {f: i for i, f in enumerate(SCREEN_FIELDS)}
_GRAD_NORM, _PARAM_NORM = FIELD_INDEX["grad_norm"], FIELD_INDEX["param_norm"]
_NONFINITE_RANKS = (FIELD_INDEX["nonfinite_loss_ranks"], FIELD_INDEX["nonfinite_input_ranks"])


def screen_values(stats: Any) -> tuple:
    """The fields of ``stats`` that :meth:`Screen.admits` reads, in :data:`SCREEN_FIELDS` order (the guard's
    healthy-step path computes the same values from the gathered row without building the stats:
    ``vidstab/guard/healthy.py``). A tuple, not a dict: right after a training step every object the screen
    touches is a cache miss, and positions are known when the gate is compiled (:meth:`Screen._compile`)."""
    return tuple(getattr(stats, f) for f in SCREEN_FIELDS)


class Screen:
    """The promises of the detectors that make them, for one step (module docstring).

    ``slots`` holds, per promising detector, its index among the plan's observers; ``bounds[k]`` is that
    detector's latest promise (``None``: none), written by :func:`vidstab.detectors.absorb`. ``detectors`` and
    ``needs`` are those detectors and the fields their ``observe`` needs, by slot; ``others`` the fields the
    other observers need, except those that declare :attr:`~vidstab.detectors.Detector.finite_quiet` (what
    :meth:`admits` reads)."""

    def __init__(self, slots: Sequence[int] = (), defer: bool = False, detectors: Sequence[Any] = (),
                 needs: Sequence[str | None] = (), others: Sequence[str | None] = ()) -> None:
        self.slots = tuple(slots)
        self.defer = defer
        """Whether :func:`vidstab.detectors.absorb` may queue steady detectors' updates (module docstring)."""
        self.detectors, self.needs, self.others = tuple(detectors), tuple(needs), tuple(others)
        self.batchable = bool(self.detectors) and len(self.detectors) == len(self.slots) and None not in self.others
        """Whether :meth:`admits` can ever clear a step: every detector that is called on every step promises."""
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
        self.changed()

    def changed(self) -> None:
        """The promises, their coverage or the waiting updates changed (:func:`vidstab.detectors.absorb` and
        everything else that makes updates or promises calls this): :meth:`admits` reads them afresh."""
        self._gate: tuple | None = None

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

    def admits(self, step: int, values: Sequence[Any], queued: int) -> int:
        """Whether a step with these :data:`SCREEN_FIELDS` values (in that order) is certain to bring no finding
        while ``queued`` steps before it (healthy ones, cleared by this method) are not absorbed yet: ``-1`` if not;
        else how many more such steps the kept promises cover after this one (0: the next step needs the
        updates made first). A guard then applies the step at once and absorbs and reports it later, with the
        others it queued (``vidstab/guard/healthy.py``).

        It is, for each detector ``judge`` would call: a promise kept from the last absorbed step that is
        steady (:attr:`~vidstab.detectors.Detector.promise_steady`) and whose bounds hold on ``values``, every
        kept promise covering the updates still to be made (``queued`` plus those the deferring plan holds,
        :attr:`pending`); for the :attr:`~vidstab.detectors.Detector.finite_quiet` ones, a finite gradient norm (and
        parameter norm, when measured) and no rank with a non-finite loss or input; the others must find the field
        they need absent. Steady promises are what make this exact: each queued step lay inside them and had no
        finding, so its update left a state they still cover. The bounds are read as :meth:`_compile` merged
        them: per field needed, the tightest of all the promises that apply."""
        return self.clears(values, queued) if self.may_admit(step, queued) else -1

    def clears(self, values: Sequence[Any], queued: int) -> int:
        """:meth:`admits` for a step :meth:`may_admit` has already let through (the guard asks that before it
        reads the step's values, and does not ask twice)."""
        first, room, others, gate = self._gate
        for i in others:
            if values[i] not in _ABSENT:
                return -1  # a detector without a promise would be called
        grad_norm, param_norm = values[_GRAD_NORM], values[_PARAM_NORM]
        if (grad_norm is None or not math.isfinite(grad_norm) or values[_NONFINITE_RANKS[0]] not in _ABSENT
                or values[_NONFINITE_RANKS[1]] not in _ABSENT or (param_norm is not None and not math.isfinite(param_norm))):
            return -1
        for need, checks in gate:
            if need >= 0 and values[need] in _ABSENT:
                continue  # not called on this step
            if checks is None:
                return -1
            for i, lo, hi in checks:
                v = values[i]
                if v is None or not lo <= v <= hi:  # NaN breaks every promise
                    return -1
        return room - queued

    def may_admit(self, step: int, queued: int) -> bool:
        """Whether :meth:`admits` can clear this step at all, before its values are read: the promises are about
        it, cover one more update, and every detector called on every step has a steady one."""
        if not self.batchable or self.step is None:
            return False
        first, room, others, gate = self._gate if self._gate is not None else self._compile()
        return step == first + queued and room >= queued and gate is not None

    def _compile(self) -> tuple:
        """``(the step the promises are about, the updates all of them still cover, the positions of the fields
        the other detectors need, the gate)``, kept until :meth:`changed`. The gate: per field a detector needs
        (its position in :data:`SCREEN_FIELDS`, -1 for those called on every step), ``None`` when one of them has
        no steady promise, else the intersection of their bounds, one ``(position, lo, hi)`` per field; the gate
        is None for every step when a detector called on every step has no steady promise, or a field that is
        needed is not a screen field."""
        room, by_need = 1 << 30, {}
        for det, need, bounds, queue in zip(self.detectors, self.needs, self.bounds, self.pending):
            key = -1 if need is None else FIELD_INDEX.get(need, -1)  # a field the screen does not read: always called
            if bounds is None or not det.promise_steady:
                if key < 0:
                    return self._hopeless(room)  # called on every step without a steady promise
                by_need[key] = None
                continue
            room = min(room, det._promise_left - len(queue))
            merged = by_need.setdefault(key, {})
            if merged is None:
                continue  # another detector of this field has none: rejected whenever it is present
            for f, lo, hi in bounds:
                i = FIELD_INDEX.get(f)
                if i is None or lo != lo or hi != hi:  # a field the screen does not read, a NaN bound: never holds
                    by_need[key] = None
                    break
                old = merged.get(i)
                merged[i] = (lo, hi) if old is None else (max(old[0], lo), min(old[1], hi))
        others = []
        for need in self.others:
            if need not in FIELD_INDEX:
                return self._hopeless(room)
            others.append(FIELD_INDEX[need])
        gate = tuple((key, None if m is None else tuple((i, lo, hi) for i, (lo, hi) in m.items()))
                     for key, m in by_need.items())
        self._gate = (self.step, room, tuple(others), gate)
        return self._gate

    def _hopeless(self, room: int) -> tuple:
        """No step is cleared until the promises change."""
        self._gate = (self.step, room, (), None)
        return self._gate
