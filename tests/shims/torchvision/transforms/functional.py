"""Part of vidstab's test stand-in for torchvision (see the package docstring): the tensor ``resize`` and ``crop``
that diffusers' ``train_cogvideox_lora.py`` uses, with torchvision's semantics; any other name is a stand-in."""

import torch

from torchvision.transforms import InterpolationMode, _Unavailable

_MODES = {InterpolationMode.NEAREST: "nearest", InterpolationMode.BILINEAR: "bilinear", InterpolationMode.BICUBIC: "bicubic"}


def resize(img: torch.Tensor, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
    """A ``[..., H, W]`` float tensor resized to ``size`` (``[h, w]``)."""
    mode = _MODES[interpolation]
    lead = img.shape[:-2]
    flat = img.reshape(-1, 1, *img.shape[-2:])
    out = torch.nn.functional.interpolate(flat, size=tuple(size), mode=mode, antialias=antialias and mode != "nearest",
                                          **({} if mode == "nearest" else {"align_corners": False}))
    return out.reshape(*lead, *out.shape[-2:])


def crop(img: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    return img[..., top:top + height, left:left + width]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"{__name__}.{name}")
