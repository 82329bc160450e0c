"""Detectors: one per file, behind the small protocol in :mod:`vidstab.detectors.base`.

``DETECTORS`` fixes the order in which they run on every rank. Step detectors come first; the
escalation detectors (``consecutive_skips``, ``repeated_spikes``) come last because they read the
verdict the others reached.
"""

from __future__ import annotations

from typing import Any

from .base import ConfigError, Detector, EMAStat, Finding, StepStats, Verdict
from .clip_rate import ClipRateConfig, ClipRateDetector
from .consecutive_skips import ConsecutiveSkipsConfig, ConsecutiveSkipsDetector
from .exception import ExceptionConfig, ExceptionDetector
from .grad_growth import GradGrowthConfig, GradGrowthDetector
from .grad_spike import GradSpikeConfig, GradSpikeDetector
from .input_range import InputRangeConfig, InputRangeDetector
from .loss_scale import LossScaleConfig, LossScaleDetector
from .loss_spike import LossSpikeConfig, LossSpikeDetector
from .lr_jump import LRJumpConfig, LRJumpDetector
from .nonfinite import NonFiniteConfig, NonFiniteDetector
from .nonfinite_params import NonFiniteParamsConfig, NonFiniteParamsDetector
from .param_growth import ParamGrowthConfig, ParamGrowthDetector
from .repeated_spikes import RepeatedSpikesConfig, RepeatedSpikesDetector
from .straggler import StragglerConfig, StragglerDetector
from .update_ratio import UpdateRatioConfig, UpdateRatioDetector

#: name -> (config class, detector class), in evaluation order.
DETECTORS: dict[str, tuple[type, type[Detector]]] = {
    "nonfinite": (NonFiniteConfig, NonFiniteDetector),
    "exception": (ExceptionConfig, ExceptionDetector),
    "nonfinite_params": (NonFiniteParamsConfig, NonFiniteParamsDetector),
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
    "consecutive_skips": (ConsecutiveSkipsConfig, ConsecutiveSkipsDetector),
    "repeated_spikes": (RepeatedSpikesConfig, RepeatedSpikesDetector),
}


def build_detectors(config: Any) -> list[Detector]:
    """Instantiate the enabled detectors of a :class:`vidstab.GuardConfig` in evaluation order."""
    out = []
    for name, (_, cls) in DETECTORS.items():
        cfg = getattr(config, name)
        if cfg.enabled:
            out.append(cls(cfg))
    return out


def judge(detectors: list[Detector], stats: StepStats) -> StepStats:
    """Run ``observe`` of every detector in order; fills ``stats.findings`` and ``stats.verdict``."""
    findings = stats.findings
    for det in detectors:
        finding = det.observe(stats)
        if finding is not None:
            findings.append(finding)
            if finding.verdict > stats.verdict:
                stats.verdict = finding.verdict
    return stats


def absorb(detectors: list[Detector], stats: StepStats) -> None:
    """Run ``update`` of every detector once ``stats.verdict``/``stats.applied`` are final (detectors
    that keep no statistics, i.e. do not override ``update``, cost nothing here)."""
    for det in detectors:
        if type(det).update is not Detector.update:
            det.update(stats)


__all__ = [
    "DETECTORS", "build_detectors", "judge", "absorb", "ConfigError", "Detector", "EMAStat", "Finding", "StepStats", "Verdict",
    "ClipRateConfig", "ConsecutiveSkipsConfig", "ExceptionConfig", "GradGrowthConfig", "GradSpikeConfig",
    "LossScaleConfig", "LossSpikeConfig", "LRJumpConfig", "UpdateRatioConfig", "InputRangeConfig", "NonFiniteConfig", "NonFiniteParamsConfig", "ParamGrowthConfig",
    "RepeatedSpikesConfig", "StragglerConfig",
]
