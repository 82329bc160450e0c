"""Detectors: one per file, behind the small protocol in :mod:`vidstab.detectors.base`.

:func:`detector_order` fixes the order in which they run on every rank: step detectors first (the
built-in ones, then those a user registered with :func:`register_detector`), escalation detectors last
(``trend``, ``consecutive_skips``, ``repeated_spikes``, ``skip_rate``, then registered escalations) because they read the
verdict the others reached. How the guard runs them (one instance per shape bucket, ``observe`` then
``update``) is :mod:`vidstab.detectors.running`.
"""

from __future__ import annotations

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
from .oom import OOMConfig, OOMDetector
from .param_growth import ParamGrowthConfig, ParamGrowthDetector
from .repeated_spikes import RepeatedSpikesConfig, RepeatedSpikesDetector
from .skip_rate import SkipRateConfig, SkipRateDetector
from .straggler import StragglerConfig, StragglerDetector
from .trend import TrendConfig, TrendDetector
from .update_ratio import UpdateRatioConfig, UpdateRatioDetector

#: Built-in step detectors: name -> (config class, detector class), in evaluation order.
STEP_DETECTORS: dict[str, tuple[type[DetectorConfig], type[Detector]]] = {
    "nonfinite": (NonFiniteConfig, NonFiniteDetector),
    "exception": (ExceptionConfig, ExceptionDetector),
    "oom": (OOMConfig, OOMDetector),
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
    "skip_rate": (SkipRateConfig, SkipRateDetector),
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


__all__ = [
    "DETECTORS", "STEP_DETECTORS", "ESCALATION_DETECTORS", "register_detector", "unregister_detector",
    "registered_detectors", "detector_order", "ConfigError",
    "Detector", "DetectorConfig", "EMAStat", "Finding", "StepStats", "Verdict", "lr_ratios", "TRIAGE", "Timeline", "family",
    "ScaleReference", "scale_reference",
    "ClipRateConfig", "ConsecutiveSkipsConfig", "ExceptionConfig", "GradGrowthConfig", "GradSpikeConfig",
    "LossScaleConfig", "LossSpikeConfig", "LRBoundConfig", "LRJumpConfig", "UpdateRatioConfig", "InputRangeConfig",
    "InputScaleConfig", "NonFiniteConfig", "NonFiniteParamsConfig", "OOMConfig", "ParamGrowthConfig",
    "RepeatedSpikesConfig", "SkipRateConfig", "StragglerConfig", "TrendConfig",
]
