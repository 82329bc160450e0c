"""Detectors: one per file, behind the small protocol in :mod:`vidstab.detectors.base`.

:func:`detector_order` fixes the order in which they run on every rank: step detectors first (the
built-in ones, then those a user registered with :func:`register_detector`), escalation detectors last
(``trend``, ``consecutive_skips``, ``repeated_spikes``, then registered escalations) because they read the
verdict the others reached. :func:`judge` runs every detector's ``observe``, :func:`absorb` every ``update``.
"""

from __future__ import annotations

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


_ABSENT = (None, [])  # what a field a detector ``needs`` holds on a step without it

MIXED_BUCKET = "mixed"
"""The bucket of a step whose ranks or micro-steps were of different shape buckets."""


class PerBucket(Detector):
    """One instance of a per-bucket detector (:attr:`Detector.per_bucket`) for each shape bucket it has seen.

    A step is judged and absorbed by the instance of its own bucket (``StepStats.bucket``), so a bucket seen for
    the first time starts with its own warm-up instead of being compared with another resolution's statistics.
    At most ``max_buckets`` instances are kept; the least recently used one is dropped beyond that."""

    def __init__(self, detector_cls: type[Detector], config: Any, max_buckets: int = 64) -> None:
        super().__init__(config)
        self.name = detector_cls.name  # type: ignore[misc]  # findings and state carry the detector's own name
        self.needs = detector_cls.needs  # type: ignore[misc]
        self.detector_cls, self.max_buckets = detector_cls, int(max_buckets)
        self.instances: dict[str, Detector] = {}
        self.current: Detector | None = None  # the instance of the last step's bucket
        self._unplaced: dict | None = None  # a state saved before buckets: given to the first bucket seen

    def of(self, bucket: str) -> Detector:
        """The instance of ``bucket`` (made on first use), now the most recently used."""
        inst = self.instances.pop(bucket, None)
        if inst is None:
            inst = self.detector_cls(self.config)
            if self._unplaced is not None:
                inst.load_state_dict(self._unplaced)
                self._unplaced = None

            while len(self.instances) >= self.max_buckets:
                self.instances.pop(next(iter(self.instances)))
        self.instances[bucket] = inst
        self.current = inst
        return inst

    def __getattr__(self, name: str) -> Any:
        """The last step's bucket's detector answers for what this wrapper does not have (its ``ema``, ...)."""
        current = self.__dict__.get("current")
        if current is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(current, name)

    def observe(self, s: StepStats) -> Finding | None:
        return self.of(s.bucket).observe(s)

    def update(self, s: StepStats) -> None:
        self.of(s.bucket).update(s)

    def published(self) -> dict[str, float]:
        return self.current.published() if self.current is not None else {}

    def state_dict(self) -> dict:
        return {"buckets": {k: d.state_dict() for k, d in self.instances.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.instances, self.current, self._unplaced = {}, None, None
        if "buckets" not in d:  # saved by a guard without buckets
            self._unplaced = d
            return
        for bucket, state in d["buckets"].items():  # saved least recently used first: the last one is current
            self.of(bucket).load_state_dict(state)


def build_detectors(config: Any, world_size: int | None = None) -> list[Detector]:
    """Instantiate the enabled detectors of a :class:`vidstab.GuardConfig` in evaluation order (those whose
    statistics depend on the shape bucket wrapped in :class:`PerBucket`).

    ``world_size``: the number of processes of the run; a detector that needs more
    (:attr:`Detector.min_world_size`, e.g. ``straggler`` compares ranks) is left out. ``None``: keep all."""
    user = registered_detectors()
    custom = getattr(config, "custom", {}) or {}
    max_buckets = getattr(config, "max_buckets", 64)
    out: list[Detector] = []
    for name in detector_order():
        if name in DETECTORS:
            cfg, cls = getattr(config, name), DETECTORS[name][1]
        else:
            cfg_cls, cls = user[name]
            cfg = custom.get(name) or cfg_cls()
        if cfg.enabled and (world_size is None or world_size >= getattr(cls, "min_world_size", 1)):
            out.append(PerBucket(cls, cfg, max_buckets) if getattr(cls, "per_bucket", False) else cls(cfg))
    return out


def judge(detectors: list[Detector], stats: StepStats) -> StepStats:
    """Run ``observe`` of every detector in order; fills ``stats.findings`` and ``stats.verdict``. A detector
    whose :attr:`Detector.needs` field is absent on this step is not called (the escalations that need
    ``findings`` see those of the detectors before them)."""
    for det in detectors:
        need = det.needs
        if need is not None and getattr(stats, need) in _ABSENT:
            continue
        finding = det.observe(stats)
        if finding is not None:
            stats.findings.append(finding)
            if finding.verdict > stats.verdict:
                stats.verdict = finding.verdict
    return stats


def absorb(detectors: list[Detector], stats: StepStats) -> None:
    """Run ``update`` of every detector once ``stats.verdict``/``stats.applied`` are final."""
    for det in detectors:
        det.update(stats)


def published(detectors: list[Detector]) -> dict[str, float]:
    """What the detectors publish about their next judgement (thresholds), merged; logged with the metrics."""
    out: dict[str, float] = {}
    for det in detectors:
        out.update(det.published())
    return out


__all__ = [
    "DETECTORS", "STEP_DETECTORS", "ESCALATION_DETECTORS", "register_detector", "unregister_detector",
    "registered_detectors", "detector_order", "build_detectors", "PerBucket", "MIXED_BUCKET", "judge", "absorb",
    "published", "ConfigError",
    "Detector", "DetectorConfig", "EMAStat", "Finding", "StepStats", "Verdict", "lr_ratios", "TRIAGE", "Timeline", "family",
    "ScaleReference", "scale_reference",
    "ClipRateConfig", "ConsecutiveSkipsConfig", "ExceptionConfig", "GradGrowthConfig", "GradSpikeConfig",
    "LossScaleConfig", "LossSpikeConfig", "LRBoundConfig", "LRJumpConfig", "UpdateRatioConfig", "InputRangeConfig",
    "InputScaleConfig", "NonFiniteConfig", "NonFiniteParamsConfig", "ParamGrowthConfig", "RepeatedSpikesConfig",
    "StragglerConfig", "TrendConfig",
]
