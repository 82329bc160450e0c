"""Part of vidstab's test stand-in for torchvision (see the package docstring): names only, none implemented."""

from torchvision.transforms import _Unavailable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"{__name__}.{name}")
