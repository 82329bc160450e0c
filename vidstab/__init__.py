"""vidstab: training-stability tooling for latent video diffusion on Hugging Face Accelerate.

Detect trouble before it happens, capture it precisely when it does, recover on its own.
The core package never imports :mod:`vidstab.reference` (the reference trainer's model and data).

Three lines in a plain Accelerate loop::

    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=output_dir)
    ...
        guard.backward(loss, batch={"latents": x, "noise": n, "timesteps": t}, sample_ids=ids)
        result = guard.step(max_grad_norm=1.0)
"""

__version__ = "0.1.0"

from .install_check import DISTRIBUTION as __distribution__  # tells this package from PyPI's other "vidstab"
from .install_check import check_same_folder as _check_same_folder

__all__ = [
    "__version__",
    "attach",
    "Guard",
    "GuardConfig",
    "StepResult",
    "StepStats",
    "Finding",
    "Verdict",
    "Detector",
    "DetectorConfig",
    "register_detector",
    "ConfigError",
    "EventLog",
    "read_events",
    "config_hash",
    # lazily imported from the other modules (see __getattr__)
    "CheckpointManager",
    "CheckpointConfig",
    "Recovery",
    "RecoveryConfig",
    "RunAborted",
    "write_incident",
    "read_incident",
    "list_incidents",
    "locate_nonfinite",
    "PreemptionHandler",
    "claim_run_dir",
    "RunDirInUse",
    "RunDirNotEmpty",
    "WithSampleIds",
    "QuarantinedDataset",
    "QuarantineList",
]

# name -> module: imported on first use, so `import vidstab` (and `vidstab --help`) does not import torch,
# and one module's problem does not break the others.
_LAZY = {
    "GuardConfig": "config",
    "config_hash": "config",
    "ConfigError": "detectors",
    "Detector": "detectors",
    "DetectorConfig": "detectors",
    "Finding": "detectors",
    "StepStats": "detectors",
    "Verdict": "detectors",
    "register_detector": "detectors",
    "EventLog": "events",
    "read_events": "events",
    "Guard": "guard",
    "StepResult": "guard",
    "attach": "guard",
    "CheckpointManager": "checkpoint",
    "CheckpointConfig": "checkpoint",
    "Recovery": "recovery.policy",
    "RecoveryConfig": "recovery.policy",
    "RunAborted": "recovery.policy",
    "write_incident": "evidence.capture",
    "read_incident": "evidence.capture",
    "list_incidents": "evidence.capture",
    "locate_nonfinite": "evidence.localize",
    "PreemptionHandler": "run.preemption",
    "claim_run_dir": "run.run_dir",
    "RunDirInUse": "run.run_dir",
    "RunDirNotEmpty": "run.run_dir",
    "WithSampleIds": "evidence.sample_ids",
    "QuarantinedDataset": "recovery.quarantine",
    "QuarantineList": "recovery.quarantine",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:  # a submodule (vidstab.faults, vidstab.guard, ...) used as an attribute
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'vidstab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_check_same_folder()
