"""Detectors: one per file, behind the small protocol in :mod:`vidstab.detectors.base`.

:func:`detector_order` fixes the order in which they run on every rank: step detectors first (the
built-in ones, then those a user registered with :func:`register_detector`), escalation detectors last
(``trend``, ``consecutive_skips``, ``repeated_spikes``, then registered escalations) because they read the
verdict the others reached. :func:`judge` calls only the detectors whose promise about the step the step
breaks, or that made none (:mod:`vidstab.detectors.screen`); :func:`absorb` takes the promises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import ConfigError, Detector, DetectorConfig, EMAStat, Finding, StepStats, Verdict, lr_ratios
from .clip_rate import ClipRateConfig, ClipRateDetector
from .consecutive_skips import ConsecutiveSkipsConfig, ConsecutiveSkipsDetector
from .diagnosis import TRIAGE, Timeline, family
from .exception import ExceptionConfig, ExceptionDetector
from .grad_growth import GradGrowthConfig, GradGrowthDetector
from .grad_spike import GradSpikeConfig, GradSpikeDetector
from .input_range import InputRangeConfig, InputRangeDetector
from .input_scale import InputScaleConfig, InputScaleDetector, ScaleReference, scale_reference
from .loss_scale import LossScaleConfig, LossScaleDetector
from .loss_spike import LossSpikeConfig, LossSpikeDetector
from .lr_bound import LRBoundConfig, LRBoundDetector
from .lr_jump import LRJumpConfig, LRJumpDetector
from .nonfinite import NonFiniteConfig, NonFiniteDetector
from .nonfinite_params import NonFiniteParamsConfig, NonFiniteParamsDetector
from .param_growth import ParamGrowthConfig, ParamGrowthDetector
from .repeated_spikes import RepeatedSpikesConfig, RepeatedSpikesDetector
from .screen import SCREEN_FIELDS, Screen, screen_values
from .straggler import StragglerConfig, StragglerDetector
from .trend import TrendConfig, TrendDetector
from .update_ratio import UpdateRatioConfig, UpdateRatioDetector

#: Built-in step detectors: name -> (config class, detector class), in evaluation order.
STEP_DETECTORS: dict[str, tuple[type[DetectorConfig], type[Detector]]] = {
    "nonfinite": (NonFiniteConfig, NonFiniteDetector),
    "exception": (ExceptionConfig, ExceptionDetector),
    "nonfinite_params": (NonFiniteParamsConfig, NonFiniteParamsDetector),
    "lr_bound": (LRBoundConfig, LRBoundDetector),
    "grad_spike": (GradSpikeConfig, GradSpikeDetector),
    "grad_growth": (GradGrowthConfig, GradGrowthDetector),
    "loss_spike": (LossSpikeConfig, LossSpikeDetector),
    "clip_rate": (ClipRateConfig, ClipRateDetector),
    "loss_scale": (LossScaleConfig, LossScaleDetector),
    "param_growth": (ParamGrowthConfig, ParamGrowthDetector),
    "lr_jump": (LRJumpConfig, LRJumpDetector),
    "update_ratio": (UpdateRatioConfig, UpdateRatioDetector),
    "input_range": (InputRangeConfig, InputRangeDetector),
    "straggler": (StragglerConfig, StragglerDetector),
    "input_scale": (InputScaleConfig, InputScaleDetector),
}
#: Built-in escalation detectors (read the verdict of the step detectors), in evaluation order.
ESCALATION_DETECTORS: dict[str, tuple[type[DetectorConfig], type[Detector]]] = {
    "trend": (TrendConfig, TrendDetector),
    "consecutive_skips": (ConsecutiveSkipsConfig, ConsecutiveSkipsDetector),
    "repeated_spikes": (RepeatedSpikesConfig, RepeatedSpikesDetector),
}
#: Every built-in detector (fields of :class:`vidstab.GuardConfig`), in evaluation order.
DETECTORS: dict[str, tuple[type[DetectorConfig], type[Detector]]] = {**STEP_DETECTORS, **ESCALATION_DETECTORS}

_USER_STEP: dict[str, tuple[type[DetectorConfig], type[Detector]]] = {}
_USER_ESCALATION: dict[str, tuple[type[DetectorConfig], type[Detector]]] = {}


def register_detector(detector_cls: type[Detector], config_cls: type[DetectorConfig] = DetectorConfig, *,
                      escalation: bool = False, replace: bool = False) -> None:
    """Add a detector of your own to every guard built afterwards, without editing vidstab.

    ``detector_cls.name`` is its name: the key of its section in the guard YAML/dict
    (``GuardConfig.from_dict({"my_rule": {"action": "skip", "limit": 3}})``) and of its findings.
    ``config_cls`` is a :class:`DetectorConfig` dataclass (``enabled``, ``action`` and your fields).
    ``escalation=True`` runs it after the step detectors (it may read ``stats.verdict``/``findings``).
    Registering a name twice, or a built-in name, raises :class:`ConfigError` unless ``replace``.
    """
    name = getattr(detector_cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or name == Detector.name:
        raise ConfigError(f"{detector_cls.__name__}.name must be an identifier naming the detector, got {name!r}")
    if not (isinstance(config_cls, type) and issubclass(config_cls, DetectorConfig)):
        raise ConfigError(f"config of detector {name!r} must be a DetectorConfig dataclass, got {config_cls!r}")
    if name in DETECTORS:
        raise ConfigError(f"detector name {name!r} is built in; choose another name")
    if not replace and (name in _USER_STEP or name in _USER_ESCALATION):
        raise ConfigError(f"detector {name!r} is already registered (pass replace=True to replace it)")
    _USER_STEP.pop(name, None)
    _USER_ESCALATION.pop(name, None)
    (_USER_ESCALATION if escalation else _USER_STEP)[name] = (config_cls, detector_cls)


def unregister_detector(name: str) -> None:
    """Remove a detector added with :func:`register_detector` (unknown names are ignored)."""
    _USER_STEP.pop(name, None)
    _USER_ESCALATION.pop(name, None)


def registered_detectors() -> dict[str, tuple[type[DetectorConfig], type[Detector]]]:
    """Detectors registered by the user: name -> (config class, detector class)."""
    return {**_USER_STEP, **_USER_ESCALATION}


def detector_order() -> list[str]:
    """Every detector name (built-in and registered) in evaluation order."""
    return [*STEP_DETECTORS, *_USER_STEP, *ESCALATION_DETECTORS, *_USER_ESCALATION]


def build_detectors(config: Any, world_size: int | None = None) -> list[Detector]:
    """Instantiate the enabled detectors of a :class:`vidstab.GuardConfig` in evaluation order.

    ``world_size``: the number of processes of the run; a detector that needs more
    (:attr:`Detector.min_world_size`, e.g. ``straggler`` compares ranks) is left out. ``None``: keep all."""
    user = registered_detectors()
    custom = getattr(config, "custom", {}) or {}
    out = []
    for name in detector_order():
        if name in DETECTORS:
            cfg, cls = getattr(config, name), DETECTORS[name][1]
        else:
            cfg_cls, cls = user[name]
            cfg = custom.get(name) or cfg_cls()
        if cfg.enabled and (world_size is None or world_size >= getattr(cls, "min_world_size", 1)):
            out.append(cls(cfg))
    return out


_ABSENT = (None, [])  # what a field a detector ``needs`` holds on a step without it


@dataclass(frozen=True)
class DetectorPlan:
    """Which detectors take part in each phase of a step, read once from their declarations
    (:attr:`Detector.needs`, :attr:`~Detector.absorbs`, :attr:`~Detector.update_needs`,
    :attr:`~Detector.publishes`) instead of on every step: right after a training step the CPU caches are
    cold and every lookup per detector per step costs a miss (judge + absorb of the default detectors take
    about 3x longer there than in a warm loop: ``benchmarks/profile_guard_step.py`` prints both). The
    detectors are called through the objects, so a method replaced on an instance is still called.
    """

    observers: tuple[tuple[Detector, str | None, int], ...]
    """``(detector, the field its observe needs, its slot in the screen or -1)`` in evaluation order."""
    absorbers: tuple[tuple[Detector, str | None, int, int], ...]
    """``(detector, the field its update needs, its slot in the screen or -1, its index among the observers)``
    of the detectors that keep statistics."""
    publishers: tuple[tuple[Detector, int], ...]
    """``(detector, its slot in the screen or -1)`` of the detectors that publish thresholds for the dashboard."""
    screen: Screen = field(default_factory=Screen)
    """The promises of the detectors that make them (:meth:`Detector.promise`) about the next steps
    (:mod:`vidstab.detectors.screen`): taken by :func:`absorb`, read by :func:`judge`. A plan kept across
    steps (the guard's) carries them; a plain list of detectors gets a fresh plan, without promises, on
    every call."""

    @classmethod
    def of(cls, detectors: "list[Detector] | DetectorPlan", defer: bool = False) -> "DetectorPlan":
        """The plan of ``detectors`` (a plan is returned as it is). Duck-typed detectors without the
        :class:`Detector` base are always called. ``defer``: updates of steady promises wait and are made
        several at once (:mod:`vidstab.detectors.screen`); whoever reads the detectors' state then calls
        :func:`catch_up` first."""
        if isinstance(detectors, DetectorPlan):
            return detectors
        # A detector that promises keeps statistics (a promise is about the state update leaves).
        slots = [i for i, d in enumerate(detectors) if getattr(d, "screens", False) and getattr(d, "absorbs", True)]
        slot_of = {i: k for k, i in enumerate(slots)}
        others = tuple(dict.fromkeys(getattr(d, "needs", None) for i, d in enumerate(detectors)
                                     if i not in slot_of and not getattr(d, "finite_quiet", False)))
        screen = Screen(slots, defer=defer, detectors=[detectors[i] for i in slots],
                        needs=[getattr(detectors[i], "needs", None) for i in slots], others=others)
        return cls(tuple((d, getattr(d, "needs", None), slot_of.get(i, -1)) for i, d in enumerate(detectors)),
                   tuple((d, getattr(d, "update_needs", None), slot_of.get(i, -1), i)
                         for i, d in enumerate(detectors) if getattr(d, "absorbs", True)),
                   tuple((d, slot_of.get(i, -1)) for i, d in enumerate(detectors) if getattr(d, "publishes", True)),
                   screen)


def judge(detectors: "list[Detector] | DetectorPlan", stats: StepStats) -> StepStats:
    """Run ``observe`` of every detector in order; fills ``stats.findings`` and ``stats.verdict``.

    A detector whose :attr:`Detector.needs` field is absent on this step is not called: it has nothing to
    judge (the escalations that need ``findings`` see those of the detectors before them); nor is one that
    promised, after the last step, to find nothing on values like this step's (:mod:`vidstab.detectors.screen`);
    one called while updates wait for it makes them first."""
    findings = stats.findings
    plan = DetectorPlan.of(detectors)
    pending = plan.screen.pending
    quiet = plan.screen.quiet(stats)
    for i, (det, need, slot) in enumerate(plan.observers):
        if i in quiet or (need is not None and getattr(stats, need) in _ABSENT):
            continue
        if slot >= 0 and pending[slot]:
            _make_waiting_updates(plan, slot)
        finding = det.observe(stats)
        if finding is not None:
            findings.append(finding)
            if finding.verdict > stats.verdict:
                stats.verdict = finding.verdict
    return stats


def absorb(detectors: "list[Detector] | DetectorPlan", stats: StepStats, defer: bool = True) -> None:
    """Run ``update`` of every detector once ``stats.verdict``/``stats.applied`` are final (detectors
    that keep no statistics, i.e. do not override ``update``, or whose :attr:`Detector.update_needs` field
    is absent this step, cost nothing here), each followed by the detector's promise about the next step
    (:class:`~vidstab.detectors.screen.Screen`). With a deferring plan, on a step without findings, the
    update of a detector the screen let through under a steady promise is queued instead (at most as many as
    the promise covers); ``defer=False`` makes this step's updates now, after those that wait (a step whose
    thresholds a tracker takes at once)."""
    plan = DetectorPlan.of(detectors)
    screen = plan.screen
    bounds, pending = screen.bounds, screen.pending
    quiet = screen.judged_quiet if defer and screen.judged is stats and not stats.findings else ()
    for det, need, slot, i in plan.absorbers:
        if need is None or getattr(stats, need) not in _ABSENT:
            if slot >= 0:
                queue = pending[slot]
                if i in quiet and det.promise_steady and len(queue) < det._promise_left:
                    queue.append([stats, None])
                    continue
                if queue:
                    _make_waiting_updates(plan, slot)
            det.update(stats)
            if slot >= 0:  # right after the update, while the detector's state is in the caches
                bounds[slot] = det.quiet_bounds()
        elif slot >= 0 and bounds[slot] is None:  # nothing to absorb, no promise yet: one about the state as it is
            bounds[slot] = det.quiet_bounds()
        # else: the state did not change, nor did the promise made on it
    screen.step = stats.step + 1
    screen.judged = None
    screen.changed()


def published(detectors: "list[Detector] | DetectorPlan", record: dict | None = None) -> dict[str, float]:
    """What the detectors publish about their next judgement (thresholds), merged; logged with the metrics.

    ``record``: the step's metrics record. A detector whose update of this step waits (a deferring plan)
    publishes into it when the update is made (:func:`catch_up`) instead; without a record it is caught up now."""
    out: dict[str, float] = {}
    plan = DetectorPlan.of(detectors)
    pending, step = plan.screen.pending, plan.screen.step
    for det, slot in plan.publishers:
        if slot >= 0 and pending[slot]:
            last = pending[slot][-1]
            if record is not None and last[0].step + 1 == step:  # this step's update waits: so does its line
                last[1] = record
                continue
            _make_waiting_updates(plan, slot)
        out.update(det.published())
    return out


def absorb_batch(plan: DetectorPlan, steps: list[StepStats]) -> list[dict[str, float]]:
    """:func:`absorb` of several consecutive steps without findings, whose verdicts and ``applied`` are final
    (the guard's queued healthy steps), made detector by detector: each detector's updates of all the steps in
    one loop, its code and state in the CPU's caches once (a detector's update reads only the step and its own
    state, so the order across detectors changes nothing). Then every promise is renewed
    (:func:`renew_promises`) and the screen is about the step after the last. Returns, per step, what the
    detectors publish after its update (its metrics line's thresholds, as :func:`published` would give)."""
    screen = plan.screen
    pending = screen.pending
    publishing = {id(det) for det, _ in plan.publishers}
    after: dict[int, list[dict[str, float]]] = {}  # per publishing detector that absorbs: published, per step
    for det, need, slot, _ in plan.absorbers:
        if slot >= 0 and pending[slot]:
            _make_waiting_updates(plan, slot)
        out = after[id(det)] = [] if id(det) in publishing else None
        for s in steps:
            if need is None or getattr(s, need) not in _ABSENT:
                det.update(s)
            if out is not None:
                out.append(det.published())
    records: list[dict[str, float]] = [{} for _ in steps]
    for det, slot in plan.publishers:  # merged in the order published() merges them
        values = after.get(id(det))
        if values is None:  # publishes without absorbing: the same after every step
            if slot >= 0 and pending[slot]:
                _make_waiting_updates(plan, slot)
            values = [det.published()] * len(steps)
        for record, v in zip(records, values):
            record.update(v)
    screen.step = steps[-1].step + 1 if steps else screen.step
    screen.judged = None
    renew_promises(plan)  # (which tells the screen they changed)
    return records


def renew_promises(plan: DetectorPlan) -> None:
    """Every promising detector (with no update waiting) makes a fresh promise about the next step, from its
    state as it is. After a batch of updates made at once (the guard's queued healthy steps) the kept promises
    run out at different steps; renewed together, they next run out together, so the next batch is as long as
    the promises allow (``vidstab/guard/healthy.py``)."""
    screen = plan.screen
    for slot, det in enumerate(screen.detectors):
        if not screen.pending[slot]:
            det.break_promise()
            screen.bounds[slot] = det.quiet_bounds()
    screen.changed()


def catch_up(detectors: "list[Detector] | DetectorPlan") -> None:
    """Make every update a deferring plan holds back (:func:`absorb`), in step order, with what the detectors
    publish after each written into that step's metrics record: call before reading the detectors' state."""
    if isinstance(detectors, DetectorPlan):
        for slot, queue in enumerate(detectors.screen.pending):
            if queue:
                _make_waiting_updates(detectors, slot)


def _make_waiting_updates(plan: DetectorPlan, slot: int) -> None:
    """The queued updates of the detector in ``slot``, each followed by its promise, as :func:`absorb` would
    have made them on their steps (the promise is steady: it stays the one the screen used)."""
    screen = plan.screen
    det = plan.observers[screen.slots[slot]][0]
    queue = screen.pending[slot]
    for stats, record in queue:
        det.update(stats)
        screen.bounds[slot] = det.quiet_bounds()
        if record is not None:
            record.update(det.published())
    queue.clear()
    screen.changed()


__all__ = [
    "DETECTORS", "STEP_DETECTORS", "ESCALATION_DETECTORS", "register_detector", "unregister_detector",
    "registered_detectors", "detector_order", "build_detectors", "DetectorPlan", "Screen", "SCREEN_FIELDS", "screen_values", "judge", "absorb", "published",
    "catch_up", "renew_promises", "absorb_batch", "ConfigError",
    "Detector", "DetectorConfig", "EMAStat", "Finding", "StepStats", "Verdict", "lr_ratios", "TRIAGE", "Timeline", "family",
    "ScaleReference", "scale_reference",
    "ClipRateConfig", "ConsecutiveSkipsConfig", "ExceptionConfig", "GradGrowthConfig", "GradSpikeConfig",
    "LossScaleConfig", "LossSpikeConfig", "LRBoundConfig", "LRJumpConfig", "UpdateRatioConfig", "InputRangeConfig",
    "InputScaleConfig", "NonFiniteConfig", "NonFiniteParamsConfig", "ParamGrowthConfig", "RepeatedSpikesConfig",
    "StragglerConfig", "TrendConfig",
]
