"""Reproducible training scenarios of the tiny reference DiT, recorded once and replayed to every detector.

``catalogue``: what each scenario does (fault, step, seeds). ``recorder``: the unguarded run that records
the per-step signals and the failure point, cached as JSON under ``benchmarks/.cache/``.
"""

from .catalogue import (
    FAULT_SEEDS, FAULT_STEP, HEALTHY, HEALTHY_SEEDS, HEALTHY_STEPS, QUICK_HEALTHY_SEEDS, QUICK_SCENARIOS,
    QUICK_SEEDS, SCENARIOS, Scenario, get,
)
from .recorder import (
    CACHE_DIR, FAILURE_FACTOR, HEALTHY_WINDOW, Recording, StepRecord, TinyRunConfig, healthy_exceedances,
    healthy_level, latent_set, record,
)

__all__ = [
    "CACHE_DIR", "FAILURE_FACTOR", "FAULT_SEEDS", "FAULT_STEP", "HEALTHY", "HEALTHY_SEEDS", "HEALTHY_STEPS",
    "HEALTHY_WINDOW", "QUICK_HEALTHY_SEEDS", "QUICK_SCENARIOS", "QUICK_SEEDS", "Recording", "SCENARIOS",
    "Scenario", "StepRecord", "TinyRunConfig", "get", "healthy_exceedances", "healthy_level", "latent_set",
    "record",
]
