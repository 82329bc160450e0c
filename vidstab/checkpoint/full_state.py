"""The full-state backend: one safetensors file (+ JSON structure) per registered object, RNG per rank.

::

    model.safetensors, optimizer.safetensors + optimizer.json, scheduler.json, scaler.json,
    ema.safetensors + ema.json, rng-rank{R}.safetensors + rng-rank{R}.json, trainer.json, vidstab.json

Models are saved from ``accelerator.get_state_dict`` (the full, unsharded state dict, written by the main
process) and loaded with ``strict=True`` into the unwrapped model (parameters that do not require grad are
fingerprinted instead of saved, see :mod:`.frozen`); every other object goes through the
pickle-free codec :mod:`vidstab.files.statedict_io`. This serves single-process and DDP runs; sharded (FSDP2)
models and their optimizers use the DCP backend instead.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import torch

from ..files import statedict_io as sio
from .config import CheckpointConfig, CheckpointError
from .dtypes import check_like, log_casts, optimizer_expectation
from .frozen import FROZEN_KEY, FingerprintCache, check_frozen, frozen_keys
from .layout import file_stem
from .memory_copy import held_metadata, held_tensors
from .writer import FileSpec

__all__ = ["FullStateBackend", "rng_state", "set_rng_state"]

logger = logging.getLogger("vidstab.checkpoint")


class FullStateBackend:
    """Snapshot, decode and apply the full state of registered objects (see module doc)."""

    name = "full"

    def __init__(self, accelerator, config: CheckpointConfig) -> None:
        self.accelerator = accelerator
        self.config = config
        self.rank = accelerator.process_index
        self.is_main = accelerator.is_main_process
        self.node_local = False
        """Node-local folders (set by the manager): see :func:`vidstab.checkpoint.manager.node_local_folders`."""
        self._host_buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.frozen = FingerprintCache()

    # ------------------------------------------------------------------ save
    def snapshot(self, objects: dict[str, Any], copy: bool, trainer_state: dict, mirror: bool = False) -> list[FileSpec]:
        """This rank's files of the checkpoint. ``copy``: into host buffers the loop may not change (async
        save); otherwise the tensors may alias live state (written before the loop continues). ``mirror``: the
        replicated files too on every rank (``write=False`` where another rank writes them), for its in-memory copy."""
        files: list[FileSpec] = []
        pinned = copy and self.config.pin_memory and torch.cuda.is_available()
        on_cuda = False
        keep = self._host_buffers if self.config.reuse_buffers else {}
        used: dict[tuple[str, str], torch.Tensor] = {}

        def host(file: str, key: str, t: torch.Tensor) -> torch.Tensor:
            nonlocal on_cuda
            t = t.detach()
            if not copy:
                return t
            on_cuda = on_cuda or t.device.type == "cuda"
            # Reusing last save's buffer avoids fresh allocations (page faults; pinned allocations are
            # slow): the copy is then the only cost the loop pays. Safe: the previous write has finished.
            dst = keep.get((file, key))
            if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned and t.device.type == "cuda")
            dst.copy_(t, non_blocking=pinned and t.device.type == "cuda")
            used[(file, key)] = dst
            return dst

        for name, obj in objects.items():
            stem = file_stem(name)
            if isinstance(obj, torch.nn.Module):
                # get_state_dict may be a collective (DeepSpeed ZeRO-3): every rank calls it.
                sd = self.accelerator.get_state_dict(obj)
                if self.is_main or mirror:
                    fn = f"{stem}.safetensors"
                    meta = {"format": "pt"}
                    frozen = frozen_keys(self.accelerator.unwrap_model(obj))
                    if frozen:  # only what training changes, plus a fingerprint of the rest (see .frozen)
                        skip = set(frozen)
                        sd = {k: v for k, v in sd.items() if k not in skip}
                        meta[FROZEN_KEY] = json.dumps(self.frozen.get(self.accelerator.unwrap_model(obj), frozen))
                    files.append(FileSpec(fn, tensors={k: host(fn, k, v) for k, v in sd.items()}, metadata=meta,
                                          write=self.is_main))
                continue
            if not (self.is_main or mirror):
                continue
            tensors, structure = sio.flatten(obj.state_dict(), prefix="t")
            files.append(FileSpec(f"{stem}.json", data=sio.dumps(structure), write=self.is_main))
            if tensors:
                fn = f"{stem}.safetensors"
                files.append(FileSpec(fn, tensors={k: host(fn, k, v) for k, v in tensors.items()}, write=self.is_main))
        files += self.common_files(trainer_state, host, mirror)
        if on_cuda:
            torch.cuda.synchronize()  # the non-blocking copies must land before the loop changes the state
        if self.config.reuse_buffers and copy:
            self._host_buffers = used
        return files

    def common_files(self, trainer_state: dict, host=lambda file, key, t: t, mirror: bool = False) -> list[FileSpec]:
        """Files every backend writes: ``scaler.json`` and ``trainer.json`` (main process; every rank's copy with
        ``mirror``, see :meth:`snapshot`), this rank's RNG."""
        files: list[FileSpec] = []
        if self.is_main or mirror:
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                files.append(FileSpec("scaler.json", data=sio.dumps(sio.flatten(scaler.state_dict())[1]),
                                      write=self.is_main))
            tensors, structure = sio.flatten(trainer_state)
            if tensors:
                raise TypeError("trainer_state must be JSON-serialisable (no tensors)")
            files.append(FileSpec("trainer.json", data=sio.dumps(structure), write=self.is_main))
        tensors, structure = sio.flatten(rng_state(), prefix="t")
        files.append(FileSpec(f"rng-rank{self.rank}.json", data=sio.dumps(structure)))
        fn = f"rng-rank{self.rank}.safetensors"
        files.append(FileSpec(fn, tensors={k: host(fn, k, v) for k, v in tensors.items()}))
        return files

    # ------------------------------------------------------------------ load
    def needed_files(self, objects: dict[str, Any]) -> dict[str, str]:
        """File a checkpoint must have for each registered object: ``{file: object name}``."""
        out = {}
        for n, obj in objects.items():
            out[f"{file_stem(n)}.safetensors" if isinstance(obj, torch.nn.Module) else f"{file_stem(n)}.json"] = n
        return out

    def decode(self, ckpt: str, raw: dict[str, bytes], objects: dict[str, Any]) -> dict:
        """Decode the verified bytes ``raw`` of checkpoint ``ckpt``: ``{"objects", "scaler", "trainer",
        "rng"}``. Raises :class:`CheckpointError` for a state that does not fit a registered model."""
        out: dict[str, Any] = {"objects": {}}
        for n, obj in objects.items():
            stem = file_stem(n)
            if isinstance(obj, torch.nn.Module):
                meta = held_metadata(raw[f"{stem}.safetensors"])
                saved = json.loads(meta[FROZEN_KEY]) if FROZEN_KEY in meta else None
                why = check_frozen(ckpt, n, self.accelerator.unwrap_model(obj), saved, self.frozen)
                if why:
                    raise CheckpointError(why)
                sd = held_tensors(raw[f"{stem}.safetensors"], clone=False)  # load_state_dict copies
                frozen = set(saved["keys"]) if saved else set()
                self.check_model_keys(ckpt, n, obj, sd, frozen)
                out["objects"][n] = sd
                if frozen:
                    out.setdefault("frozen", {})[n] = frozen
            else:
                tensors = held_tensors(raw[f"{stem}.safetensors"]) if f"{stem}.safetensors" in raw else {}
                state = sio.unflatten(sio.loads(raw[f"{stem}.json"], f"{stem}.json"), tensors)
                out["objects"][n] = self.check_types(ckpt, n, obj, state) if tensors else state
        out.update(self.decode_common(raw, ckpt))
        return out

    def check_types(self, ckpt: str, name: str, obj: Any, state: Any) -> Any:
        """``state`` checked against what ``obj`` holds (dtypes and shapes, :mod:`.dtypes`), with the casts
        ``cast_dtypes`` allows applied and logged."""
        from .dcp_backend import is_optimizer  # dcp_backend imports this module: import late

        current = optimizer_expectation(obj, state) if is_optimizer(obj) else obj.state_dict()
        casts: list[str] = []
        state = check_like(ckpt, name, state, current, self.config.cast_dtypes, casts)
        log_casts(ckpt, name, casts)
        return state

    def decode_common(self, raw: dict[str, bytes], ckpt: str = "checkpoint") -> dict:
        """``scaler``, ``trainer`` and this rank's ``rng`` (checked against this process's RNG states' dtypes and
        shapes) from the verified bytes ``raw``."""
        out: dict[str, Any] = {}
        out["scaler"] = sio.unflatten(sio.loads(raw["scaler.json"], "scaler.json"), {}) if "scaler.json" in raw else None
        out["trainer"] = sio.unflatten(sio.loads(raw["trainer.json"], "trainer.json"), {}) if "trainer.json" in raw else {}
        rj = f"rng-rank{self.rank}.json"
        out["rng"] = (sio.unflatten(sio.loads(raw[rj], rj), held_tensors(raw[f"rng-rank{self.rank}.safetensors"]))
                      if rj in raw else None)
        if out["rng"] is not None:  # never cast: an RNG state of another dtype is another generator's
            out["rng"] = check_like(ckpt, f"rng-rank{self.rank}", out["rng"], rng_state())
        return out

    def check_model_keys(self, ckpt: str, name: str, model: torch.nn.Module, sd: dict,
                         frozen: set[str] = frozenset()) -> None:
        """Refuse a state dict whose keys, shapes or dtypes differ from ``model``'s (less its ``frozen``
        parameters, which the checkpoint fingerprints instead of holding), naming the parameter; with
        ``cast_dtypes``, a floating tensor of another floating dtype is loaded (``load_state_dict`` casts it)
        and logged."""
        ref = {k: v for k, v in self.accelerator.unwrap_model(model).state_dict().items() if k not in frozen}
        missing, extra = set(ref) - set(sd), set(sd) - set(ref)
        if missing or extra:
            raise CheckpointError(f"{ckpt}: {name!r} does not match the model (missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(extra)[:5]})")
        for k, v in sd.items():
            if tuple(v.shape) != tuple(ref[k].shape):
                raise CheckpointError(f"{ckpt}: {name}.{k} has shape {tuple(v.shape)}, model has {tuple(ref[k].shape)}")
        casts: list[str] = []
        check_like(ckpt, name, sd, ref, self.config.cast_dtypes, casts)  # load_state_dict casts what is allowed
        log_casts(ckpt, name, casts)

    def apply(self, payload: dict, objects: dict[str, Any]) -> None:
        """Load a decoded payload into the registered objects, the scaler and this rank's RNG."""
        for n, obj in objects.items():
            state = payload["objects"][n]
            if isinstance(obj, torch.nn.Module):
                frozen = payload.get("frozen", {}).get(n)
                result = self.accelerator.unwrap_model(obj).load_state_dict(state, strict=not frozen)
                if frozen and (set(result.missing_keys) != frozen or result.unexpected_keys):
                    raise CheckpointError(f"{n!r}: state does not fit the model ({result})")  # checked in decode
            else:
                obj.load_state_dict(state)
        self.apply_common(payload)

    def apply_common(self, payload: dict) -> None:
        """Restore the scaler and this rank's RNG from a decoded payload."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and payload["scaler"] is not None:
            scaler.load_state_dict(payload["scaler"])
        if payload["rng"] is not None:
            set_rng_state(payload["rng"])
        else:
            logger.warning("checkpoint has no RNG state for rank %d (world size changed?); RNG not restored",
                           self.rank)


# ---------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's torch, numpy, Python (and CUDA) RNG states."""
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Inverse of :func:`rng_state` (CUDA states only where the device count matches)."""
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in st and torch.cuda.is_available():
        states = st["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            logger.warning("checkpoint has %d CUDA RNG states, this process sees %d devices; CUDA RNG not restored",
                           len(states), torch.cuda.device_count())
