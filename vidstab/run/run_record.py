"""What a run ran with, beyond its flags: the effective mixed precision (also when only `accelerate launch
--mixed_precision` or `accelerate config` set it), the number of processes and the library versions."""

from __future__ import annotations

from importlib import metadata
from typing import Any

#: The libraries whose versions a run record names.
RECORDED_PACKAGES = ("torch", "accelerate", "diffusers", "vidstab")


def package_versions(names: tuple[str, ...] = RECORDED_PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (``None``: not installed), read from its metadata without importing it."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    if versions.get("vidstab") is None:  # a checkout on PYTHONPATH without an install
        from .. import __version__

        versions["vidstab"] = __version__
    return versions


def run_environment(accelerator: Any) -> dict[str, Any]:
    """The effective settings of ``accelerator`` and the versions, as plain JSON/YAML values."""
    return {
        "mixed_precision": str(accelerator.mixed_precision),
        "world_size": int(accelerator.num_processes),
        "distributed_type": str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)),
        "versions": package_versions(),
    }
