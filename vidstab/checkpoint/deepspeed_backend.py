"""The DeepSpeed backend: a ZeRO engine's per-rank fp32 partitions and optimizer state as safetensors + JSON.

DeepSpeed's own checkpoints (``engine.save_checkpoint``, ``accelerator.save_state``) are pickles that need
``torch.load(weights_only=False)``. Here every rank writes what it owns, as plain tensors
(:class:`vidstab.engines.deepspeed_support.ZeroPartitions`); the module weights are rebuilt from them at load::

    model.json                    the engine's layout (ZeRO stage, world size, partition sizes; main process)
    model.safetensors             the module's full weights in their training dtype (main process; gathered at
                                  ZeRO-3): what ``vidstab replay`` loads; a resume reads the partitions
    model-rank{R}.safetensors     rank R's fp32 master partitions and their optimizer state (Adam's moments)
    model-rank{R}.json            rank R's layout, the optimizer's non-tensor state and param-group values,
                                  the engine's step counters
    optimizer.json                a marker: the optimizer's state travels with the model's files

plus the files every backend writes (``trainer.json``, ``rng-rank{R}.*``) and the JSON/safetensors of the other
registered objects (scheduler, guard, EMA) as in the full-state backend. A checkpoint loads into a run of the
same ZeRO stage, number of processes and model; anything else is refused, saying what to relaunch with.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..files import statedict_io as sio
from ..engines.deepspeed_support import ZeroPartitions, engine_of
from .config import CheckpointError
from .dcp_backend import is_optimizer
from .full_state import FullStateBackend
from .layout import file_stem
from .writer import FileSpec

__all__ = ["DeepSpeedBackend"]


def _is_engine(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and hasattr(obj, "zero_optimization_stage")


class DeepSpeedBackend(FullStateBackend):
    """Snapshot, decode and apply a DeepSpeed run's state (see module doc)."""

    name = "deepspeed"
    _full_weight_files: set[str] = set()

    def _split(self, objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(engines, their optimizers, everything else) among the registered objects."""
        engines = {n: o for n, o in objects.items() if _is_engine(o)}
        if not engines and any(isinstance(o, torch.nn.Module) for o in objects.values()):
            engines = {n: engine_of(self.accelerator) for n, o in objects.items() if isinstance(o, torch.nn.Module)}
        optimizers = {n: o for n, o in objects.items() if n not in engines and is_optimizer(o)}
        others = {n: o for n, o in objects.items() if n not in engines and n not in optimizers}
        return engines, optimizers, others

    def snapshot(self, objects: dict[str, Any], copy: bool, trainer_state: dict) -> list[FileSpec]:
        engines, optimizers, others = self._split(objects)
        files = super().snapshot(others, copy, trainer_state)  # other objects + trainer.json + this rank's RNG
        for n, engine in engines.items():
            stem = file_stem(n)
            parts = ZeroPartitions(engine)
            tensors, structure = parts.state()
            if copy:  # the loop goes on while the writer writes: a copy it cannot change
                tensors = {k: v.clone() for k, v in tensors.items()}
            values, struct = sio.flatten(structure, prefix="t")
            if values:
                raise TypeError(f"{n}: non-tensor optimizer state holds tensors: {sorted(values)[:3]}")
            files.append(FileSpec(f"{stem}-rank{self.rank}.safetensors", tensors=tensors, metadata={"format": "pt"}))
            files.append(FileSpec(f"{stem}-rank{self.rank}.json", data=sio.dumps(struct)))
            full = parts.full_weights(self.is_main)  # a collective at ZeRO-3
            if self.is_main:
                files.append(FileSpec(f"{stem}.json", data=json.dumps(parts.layout()).encode()))
                files.append(FileSpec(f"{stem}.safetensors", tensors=full, metadata={"format": "pt"}))
        if self.is_main:
            for n in optimizers:
                marker = {"deepspeed": "this optimizer's state is in the model's per-rank files"}
                files.append(FileSpec(f"{file_stem(n)}.json", data=json.dumps(marker).encode()))
        return files

    def needed_files(self, objects: dict[str, Any]) -> dict[str, str]:
        engines, optimizers, others = self._split(objects)
        out = super().needed_files(others)
        for n in (*engines, *optimizers):
            out[f"{file_stem(n)}.json"] = n
        self._full_weight_files = {f"{file_stem(n)}.safetensors" for n in engines}
        return out

    def keep_file(self, f: str) -> bool:
        """This rank reads its own partitions only (the others' are verified by their owners and rank 0), not
        the full weights (for replay; a load rebuilds them from the partitions)."""
        if f in self._full_weight_files:
            return False
        stem, sep, rest = f.rpartition("-rank")
        return not (sep and rest.split(".")[0].isdigit() and rest.split(".")[0] != str(self.rank)
                    and not f.startswith("rng-rank"))

    def decode(self, ckpt: str, raw: dict[str, bytes], objects: dict[str, Any]) -> dict:
        from safetensors.torch import load as st_load

        engines, _, others = self._split(objects)
        out = super().decode(ckpt, raw, others)
        out["engines"] = {}
        for n, engine in engines.items():
            stem = file_stem(n)
            parts = ZeroPartitions(engine)
            why = parts.check(ckpt, json.loads(raw[f"{stem}.json"]), None)  # world size, stage: before anything else
            mine = f"{stem}-rank{self.rank}"
            if why is None and (f"{mine}.json" not in raw or f"{mine}.safetensors" not in raw):
                why = f"{ckpt}: has no ZeRO partitions of rank {self.rank} ({mine}.safetensors)"
            if why is None:
                structure = sio.unflatten(sio.loads(raw[f"{mine}.json"]), {})
                tensors = st_load(raw[f"{mine}.safetensors"])
                why = parts.check(ckpt, structure, tensors)
            if why:
                raise CheckpointError(why)
            out["engines"][n] = (tensors, structure)
        return out

    def apply(self, payload: dict, objects: dict[str, Any]) -> None:
        engines, _, others = self._split(objects)
        for n, engine in engines.items():
            ZeroPartitions(engine).load(*payload["engines"][n])  # a collective: every rank
        super().apply(payload, others)

    def params_finite(self, objects: dict[str, Any]) -> bool:
        """Whether this rank's fp32 master weights are all finite (the module's ZeRO-3 parameters are empty; the
        partitions' padding holds no weights)."""
        engines, _, _ = self._split(objects)
        return all(bool(torch.isfinite(t).all()) for e in engines.values() for t in ZeroPartitions(e).real())
