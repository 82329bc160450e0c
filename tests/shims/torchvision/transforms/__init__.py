"""PIL/tensor image transforms with torchvision's semantics, for the ones ``train_unconditional.py`` uses."""

from __future__ import annotations

import enum
import random

import numpy as np
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    NEAREST = Image.NEAREST
    BILINEAR = Image.BILINEAR
    BICUBIC = Image.BICUBIC
    # torchvision's other modes (other libraries name them at import time)
    BOX = Image.BOX
    HAMMING = Image.HAMMING
    LANCZOS = Image.LANCZOS
    NEAREST_EXACT = "nearest-exact"


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Lambda:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


class Resize:
    """Resize so that the shorter side is ``size`` (an int), as torchvision does."""

    def __init__(self, size: int, interpolation: InterpolationMode = InterpolationMode.BILINEAR):
        self.size, self.interpolation = size, interpolation

    def __call__(self, img):
        if isinstance(img, torch.Tensor):
            h, w = img.shape[-2:]
            s = self.size / min(h, w)
            return torch.nn.functional.interpolate(img[None].float(), size=(round(h * s), round(w * s)),
                                                   mode="bilinear", align_corners=False)[0]
        w, h = img.size
        s = self.size / min(w, h)
        return img.resize((round(w * s), round(h * s)), self.interpolation.value)


def _crop(img, top: int, left: int, size: int):
    if isinstance(img, torch.Tensor):
        return img[..., top:top + size, left:left + size]
    return img.crop((left, top, left + size, top + size))


def _hw(img):
    return tuple(img.shape[-2:]) if isinstance(img, torch.Tensor) else (img.size[1], img.size[0])


class CenterCrop:
    def __init__(self, size: int):
        self.size = size

    def __call__(self, img):
        h, w = _hw(img)
        return _crop(img, int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0)), self.size)


class RandomCrop:
    def __init__(self, size: int):
        self.size = size

    def __call__(self, img):
        h, w = _hw(img)
        return _crop(img, random.randint(0, h - self.size), random.randint(0, w - self.size), self.size)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img):
        if random.random() >= self.p:
            return img
        return img.flip(-1) if isinstance(img, torch.Tensor) else img.transpose(Image.FLIP_LEFT_RIGHT)


class PILToTensor:
    def __call__(self, img):
        return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1).contiguous()


class ConvertImageDtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, t):
        return t.to(self.dtype) / 255.0 if not t.is_floating_point() else t.to(self.dtype)


class ToTensor:
    """HWC uint8 PIL -> CHW float in [0, 1]."""

    def __call__(self, img):
        return torch.from_numpy(np.array(img, dtype=np.float32, copy=True) / 255.0).permute(2, 0, 1).contiguous()


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)

    def __call__(self, t):
        return (t - self.mean[:, None, None]) / self.std[:, None, None]


def __getattr__(name: str):
    """Anything else torchvision.transforms has (other libraries, e.g. transformers, import names at import time):
    a stand-in that says it is one when called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(f"torchvision.transforms.{name}")


class _Unavailable:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name} is not in vidstab's test stand-in for torchvision")
