"""PEFT adapters in the model spec a replay rebuilds from (:mod:`vidstab.evidence.replay_record`), recorded at attach.

A diffusers model fine-tuned with LoRA (``model.add_adapter(LoraConfig(...))``) is its base model plus
adapters. A checkpoint of it holds only the adapters and a fingerprint of the frozen base
(:mod:`vidstab.checkpoint.frozen`), so a replay needs the base's weights as the run had them as well as the
adapters' configuration. :func:`adapter_spec_of` records both, as plain JSON: each adapter's ``LoraConfig``
as a dict (``model.peft_config``), the active adapters, where the base was loaded from (``from_pretrained``'s
path or hub id and the pipeline subfolder) and the dtypes the run kept the base and the adapters in.
``vidstab.tools.replay.adapters`` rebuilds the model from it; this module imports neither peft nor diffusers.
"""

from __future__ import annotations

import os

import torch

from ..files.limits import read_json_file
from .replay_record import plain_json

MAX_ADAPTERS = 16
"""Adapters recorded at most (a model with more gets no spec: a replay then needs the user's factory)."""


def adapter_spec_of(model: torch.nn.Module) -> dict | None:
    """``{"adapters", "active", "base", "adapter_dtype"}`` for a model holding PEFT adapters (None: it holds
    none, or more than :data:`MAX_ADAPTERS`, or one whose config cannot be written as a dict)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs or len(configs) > MAX_ADAPTERS:
        return None
    adapters = {}
    for name, config in configs.items():
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            return None
        adapters[str(name)] = plain_json(to_dict())
    active = getattr(model, "active_adapters", None)
    try:
        active = list(active() if callable(active) else active or [])
    except Exception:  # noqa: BLE001 - diffusers raises when no adapter is active: record none then
        active = []
    frozen = next((p for p in model.parameters() if not p.requires_grad), None)
    trained = next((p for p in model.parameters() if p.requires_grad), None)
    return {"adapters": adapters, "active": [str(a) for a in active],
            "base": {**_pretrained_source(model), "dtype": _dtype_name(frozen)},
            "adapter_dtype": _dtype_name(trained)}


def _pretrained_source(model: torch.nn.Module) -> dict:
    """Where ``from_pretrained`` loaded the base from: ``{"pretrained": path or hub id, "subfolder"}``; a local
    path as an absolute one, and the subfolder a pipeline folder holds the model's class in."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or (config.get("_name_or_path") if isinstance(config, dict) else None)
    if not isinstance(name, str) or not name:
        return {"pretrained": None, "subfolder": None}
    if not os.path.isdir(name):  # a hub id: its pipeline index from the local cache (a replay reads only that)
        return {"pretrained": name, "subfolder": _component_subfolder(_cached_repo(name), type(model).__name__)}
    root = os.path.abspath(name)
    return {"pretrained": root, "subfolder": _component_subfolder(root, type(model).__name__)}


def _cached_repo(repo_id: str) -> str | None:
    """The local cache's folder of the hub repository ``repo_id`` (its ``model_index.json``'s), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache  # diffusers' own dependency: there with its models

        index = try_to_load_from_cache(repo_id, "model_index.json")
    except Exception:  # noqa: BLE001 - not installed, not a repo id: no subfolder recorded
        return None
    return os.path.dirname(index) if isinstance(index, str) else None


def _component_subfolder(root: str | None, class_name: str) -> str | None:
    """The component of the pipeline folder ``root`` whose class is ``class_name`` (``model_index.json``);
    None when ``root`` is the model's own folder or no single component has that class."""
    if root is None or os.path.isfile(os.path.join(root, "config.json")):
        return None
    try:
        index = read_json_file(os.path.join(root, "model_index.json"))
    except (OSError, ValueError):
        return None
    names = [k for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[1] == class_name] \
        if isinstance(index, dict) else []
    return names[0] if len(names) == 1 else None


def _dtype_name(param: torch.Tensor | None) -> str | None:
    return None if param is None else str(param.dtype).removeprefix("torch.")

