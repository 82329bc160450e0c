"""A stand-in for the part of torchvision that diffusers' ``train_unconditional.py`` and ``train_cogvideox_lora.py``
import (``transforms``, ``transforms.functional``'s ``resize`` and ``crop``), used by the drills on them
(tests/scripts/drill.py) only when torchvision is not installed.

Why: torchvision is no dependency of vidstab, and an unpinned ``pip install torchvision`` on a machine with
torch 2.13 resolves to a torchvision that pulls a different torch. The script under test is diffusers'
own; these few image transforms are plain PIL/tensor operations with torchvision's semantics.
"""

__version__ = "0.28.0+vidstab.shim"  # libraries that see torchvision installed read its version


def __getattr__(name: str):
    """Submodules other libraries import by name (``torchvision.io``, ...): stand-ins whose names say what they are."""
    if name.startswith("__"):
        raise AttributeError(name)
    import types

    from .transforms import _Unavailable

    module = types.ModuleType(f"torchvision.{name}")
    module.__getattr__ = lambda attr: _Unavailable(f"torchvision.{name}.{attr}")  # type: ignore[attr-defined]
    return module
