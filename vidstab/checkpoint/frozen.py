"""Frozen parameters (a LoRA/PEFT fine-tune's base weights, a frozen text encoder): fingerprinted, not saved.

A checkpoint of a model with parameters that do not require grad holds only what training changes (the
trainable parameters and every buffer) plus a fingerprint of the frozen ones: their names, dtypes, shapes
and a CRC-32 of their bytes, in the safetensors header of the model's file (``vidstab_frozen``). Loading it
leaves the frozen weights in place and refuses a model whose frozen weights differ from the fingerprint
(another base model, another revision), naming what differs; a resume onto the wrong base would otherwise
combine trained adapters with weights they were never trained against.

The fingerprint reads every frozen byte once (on the host), so it is cached per model while no frozen
tensor has been modified in place (``Tensor._version``) or replaced.
"""

from __future__ import annotations

import json
import struct
import zlib

import torch

__all__ = ["FROZEN_KEY", "frozen_keys", "fingerprint", "FingerprintCache", "read_header_metadata", "check_frozen"]

FROZEN_KEY = "vidstab_frozen"
"""safetensors header metadata key holding the fingerprint (a JSON string)."""


def frozen_keys(module: torch.nn.Module) -> list[str]:
    """State-dict names of the parameters of ``module`` that do not require grad (every alias of a shared
    parameter; one that is also reachable as a trainable parameter is trainable)."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    return sorted(n for n, p in module.named_parameters(remove_duplicate=False)
                  if not p.requires_grad and id(p) not in trainable)


def fingerprint(module: torch.nn.Module, keys: list[str]) -> dict:
    """``{"tensors", "bytes", "crc32"}`` of the parameters ``keys`` of ``module`` (names, dtypes, shapes and
    bytes, in name order)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    crc, total = 0, 0
    for k in keys:
        t = params[k].detach()
        crc = zlib.crc32(f"{k}|{t.dtype}|{tuple(t.shape)}".encode(), crc)
        data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        crc = zlib.crc32(memoryview(data), crc)
        total += data.nbytes
    return {"tensors": len(keys), "bytes": total, "crc32": f"0x{crc:08x}"}


class FingerprintCache:
    """Fingerprints of frozen parameters, recomputed only when one of them changed."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[tuple, dict]] = {}

    def get(self, module: torch.nn.Module, keys: list[str]) -> dict:
        params = dict(module.named_parameters(remove_duplicate=False))
        stamp = tuple((k, params[k].data_ptr(), params[k]._version) for k in keys)
        hit = self._cache.get(id(module))
        if hit is None or hit[0] != stamp:
            hit = (stamp, {"keys": keys, **fingerprint(module, keys)})
            self._cache[id(module)] = hit
        return hit[1]


def read_header_metadata(raw: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file given as bytes (already verified against its manifest)."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]).get("__metadata__") or {}


def check_frozen(ckpt: str, name: str, module: torch.nn.Module, saved: dict | None, cache: FingerprintCache) -> str | None:
    """Why the frozen weights of ``module`` do not match the fingerprint ``saved`` (None: they match, or the
    checkpoint has none and the model has none)."""
    if saved is None:  # a full checkpoint: it holds the frozen weights too, and they are loaded
        return None
    keys = frozen_keys(module)
    if sorted(saved.get("keys", [])) != keys:
        missing = sorted(set(saved.get("keys", [])) - set(keys))[:5]
        extra = sorted(set(keys) - set(saved.get("keys", [])))[:5]
        return (f"{ckpt}: {name!r} was saved with other frozen parameters (frozen then, not now: {missing}; "
                f"frozen now, not then: {extra}); set requires_grad as in the run that saved it")
    now = cache.get(module, keys)
    if (now["crc32"], now["bytes"]) != (saved.get("crc32"), saved.get("bytes")):
        return (f"{ckpt}: {name!r} was trained on other frozen (base) weights: fingerprint {saved.get('crc32')} over "
                f"{saved.get('tensors')} tensors then, {now['crc32']} now. Load the same base model (and revision) "
                "before resuming; the checkpoint holds only the trained parameters")
    return None
