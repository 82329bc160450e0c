"""How the guard runs the detectors: built from a :class:`vidstab.GuardConfig` in :func:`detector_order`, one
instance per shape bucket for those whose statistics depend on it (:class:`PerBucket`), :func:`judge` (every
``observe``) before the optimizer step and :func:`absorb` (every ``update``) after it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import DETECTORS, detector_order, registered_detectors
from .base import Detector, Finding, StepStats

_ABSENT = (None, [])  # what a field a detector ``needs`` holds on a step without it

MIXED_BUCKET = "mixed"
"""The bucket of a step whose ranks or micro-steps were of different shape buckets."""


POOLED_RATIO_MARGIN = 2.0
"""A step of a bucket still in warm-up is judged against every bucket's steps by the ratio test alone, at this many
times the configured ``ratio`` (:class:`PerBucket`): the buckets' healthy levels differ by a few times, a fault
by an order of magnitude; a z-score against steps of other buckets would mistake the first for the second."""


class PerBucket(Detector):
    """One instance of a per-bucket detector (:attr:`Detector.per_bucket`) for each shape bucket it has seen.

    A step is judged and absorbed by the instance of its own bucket (``StepStats.bucket``), so a bucket seen for
    the first time starts with its own warm-up instead of being compared with another resolution's statistics.
    Until that bucket has its config's ``warmup_steps`` applied steps, a step its own instance does not flag is
    judged by a pooled instance that absorbs every bucket's steps, by its ratio test alone at
    :data:`POOLED_RATIO_MARGIN` times the ``ratio`` (detectors whose config has a ``ratio``): a new resolution is
    not a fault, a loss ten times the usual level still is.
    At most ``max_buckets`` instances are kept; the least recently used one is dropped beyond that."""

    def __init__(self, detector_cls: type[Detector], config: Any, max_buckets: int = 64) -> None:
        super().__init__(config)
        self.name = detector_cls.name  # type: ignore[misc]  # findings and state carry the detector's own name
        self.needs = detector_cls.needs  # type: ignore[misc]
        self.detector_cls, self.max_buckets = detector_cls, int(max_buckets)
        self.instances: dict[str, Detector] = {}
        self.applied: dict[str, int] = {}  # applied steps each bucket's instance has absorbed
        self.current: Detector | None = None  # the instance of the last step's bucket
        self.current_bucket: str | None = None
        self.warmup = int(getattr(config, "warmup_steps", 0) or 0)
        self.pooled = None  # judges the steps of a bucket in warm-up (POOLED_RATIO_MARGIN), absorbs every step
        if self.warmup and hasattr(config, "ratio") and dataclasses.is_dataclass(config):
            ratio_only = {"ratio": config.ratio * POOLED_RATIO_MARGIN}
            if hasattr(config, "zscore"):
                ratio_only["zscore"] = math.inf
            self.pooled = detector_cls(dataclasses.replace(config, **ratio_only))
        self._unplaced: dict | None = None  # a state saved before buckets: given to the first bucket seen

    def of(self, bucket: str) -> Detector:
        """The instance of ``bucket`` (made on first use), now the most recently used."""
        if bucket == self.current_bucket:
            return self.current  # type: ignore[return-value]
        inst = self.instances.pop(bucket, None)
        if inst is None:
            inst = self.detector_cls(self.config)
            self.applied[bucket] = 0
            if self._unplaced is not None:
                inst.load_state_dict(self._unplaced)
                self.applied[bucket] = self.warmup  # the state of a guard without buckets: warm already
                self._unplaced = None
            while len(self.instances) >= self.max_buckets:
                oldest = next(iter(self.instances))
                del self.instances[oldest]
                self.applied.pop(oldest, None)
        self.instances[bucket] = inst
        self.current, self.current_bucket = inst, bucket
        return inst

    def __getattr__(self, name: str) -> Any:
        """The last step's bucket's detector answers for what this wrapper does not have (its ``ema``, ...)."""
        current = self.__dict__.get("current")
        if current is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(current, name)

    def observe(self, s: StepStats) -> Finding | None:
        finding = self.of(s.bucket).observe(s)
        if finding is None and self.pooled is not None and self.applied[s.bucket] < self.warmup:
            finding = self.pooled.observe(s)
        return finding

    def update(self, s: StepStats) -> None:
        self.of(s.bucket).update(s)
        self.applied[s.bucket] += bool(s.applied)
        if self.pooled is not None:
            self.pooled.update(s)

    def published(self) -> dict[str, float]:
        return self.current.published() if self.current is not None else {}

    def state_dict(self) -> dict:
        out = {"buckets": {k: d.state_dict() for k, d in self.instances.items()}, "applied": dict(self.applied)}
        if self.pooled is not None:
            out["pooled"] = self.pooled.state_dict()
        return out

    def load_state_dict(self, d: dict) -> None:
        self.instances, self.applied, self.current, self.current_bucket, self._unplaced = {}, {}, None, None, None
        if "buckets" not in d:  # saved by a guard without buckets
            self._unplaced = d
            return
        applied = d.get("applied", {})
        for bucket, state in d["buckets"].items():  # saved least recently used first: the last one is current
            self.of(bucket).load_state_dict(state)
            self.applied[bucket] = int(applied.get(bucket, self.warmup))  # saved without counts: warm
        if self.pooled is not None and "pooled" in d:
            self.pooled.load_state_dict(d["pooled"])


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
