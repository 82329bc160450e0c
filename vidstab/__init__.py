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

from .config import GuardConfig, config_hash
from .detectors import ConfigError, Detector, DetectorConfig, Finding, StepStats, Verdict, register_detector
from .events import EventLog, read_events
from .guard import Guard, StepResult, attach

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

# name -> module: imported on first use, so `import vidstab` stays light and one module's problem does
# not break the others.
_LAZY = {
    "CheckpointManager": "checkpoint",
    "CheckpointConfig": "checkpoint",
    "Recovery": "recovery",
    "RecoveryConfig": "recovery",
    "RunAborted": "recovery",
    "write_incident": "capture",
    "read_incident": "capture",
    "list_incidents": "capture",
    "locate_nonfinite": "localize",
    "PreemptionHandler": "preemption",
    "claim_run_dir": "run_dir",
    "RunDirInUse": "run_dir",
    "RunDirNotEmpty": "run_dir",
    "WithSampleIds": "sample_ids",
    "QuarantinedDataset": "quarantine",
    "QuarantineList": "quarantine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vidstab' has no attribute {name!r}")
