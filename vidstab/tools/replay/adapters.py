"""Rebuilding a diffusers model with PEFT adapters from a bundle's ``model.peft`` record (:mod:`vidstab.evidence.adapter_record`).

The base comes back as the run had it: ``from_pretrained`` on the recorded path (or hub id, local cache
only), safetensors files only, after its ``config.json`` is checked against the recorded config (so the
size check of the recorded architecture holds for what is loaded), cast to the recorded dtype. Each
adapter is a ``peft.LoraConfig`` built from the recorded dict and added with diffusers' ``add_adapter``; the
checkpoint's adapter weights and the fingerprint check of the base follow in :mod:`.rebuild`. Only plain
LoRA is rebuilt: fields that make peft import a module (``megatron_core``), initialisations that change the
base or need data (PiSSA, LoftQ, EVA, ...) and other adapter types are refused, naming the field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from ...files.limits import read_json_file
from ...evidence.replay_record import plain_json
from .base import ReplayError

#: ``init_lora_weights`` values rebuilt: the plain initialisations, none of which reads the base or data.
PLAIN_INITS = (True, False, "gaussian")
#: The dtypes a base or an adapter may be recorded in.
DTYPES = ("float32", "bfloat16", "float16", "float64")
#: LoraConfig fields dropped before it is built: bookkeeping, or a module name peft would import.
IGNORED_FIELDS = {"peft_version", "base_model_name_or_path", "revision", "auto_mapping", "megatron_core", "runtime_config"}


def build_with_adapters(cls: Any, config: dict, record: Any, what: str) -> nn.Module:
    """``cls`` rebuilt from ``config`` with the adapters of ``record``; its base loaded as the run loaded it,
    except on the meta device (the size check before the real build: no weights read)."""
    if not isinstance(record, dict) or not isinstance(record.get("adapters"), dict) or not record["adapters"]:
        raise ReplayError(f"{what}: 'peft' must be {{'adapters': {{name: LoraConfig dict}}, ...}}, got {type(record).__name__}")
    try:
        from peft import LoraConfig
    except ImportError:
        raise ReplayError(f"{what} holds PEFT adapters: the replay needs peft (pip install 'vidstab-train[peft]')") from None
    lora_configs = {str(name): _lora_config(LoraConfig, name, cfg, what) for name, cfg in record["adapters"].items()}
    base = record.get("base") if isinstance(record.get("base"), dict) else {}
    shape_only = torch.empty(0).device.type == "meta"
    model = cls.from_config(config) if shape_only or not base.get("pretrained") else _pretrained(cls, config, base, what)
    base_dtype = _dtype(base.get("dtype"), what)
    if base_dtype is not None and not shape_only and any(p.dtype != base_dtype for p in model.parameters()):
        model.to(dtype=base_dtype)
    for name, lora in lora_configs.items():
        try:
            model.add_adapter(lora, adapter_name=name)
        except Exception as e:  # noqa: BLE001 - peft's and diffusers' own refusals, named
            raise ReplayError(f"{what}: adding adapter {name!r} failed: {type(e).__name__}: {e}") from e
    adapter_dtype = _dtype(record.get("adapter_dtype"), what)
    if adapter_dtype is not None and not shape_only:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(adapter_dtype)
    active = [a for a in record.get("active") or [] if a in lora_configs]
    if active and hasattr(model, "set_adapter"):
        model.set_adapter(active if len(active) > 1 else active[0])
    return model


def _lora_config(lora_cls: Any, name: Any, recorded: Any, what: str) -> Any:
    where = f"{what}, adapter {name!r}"
    if not isinstance(recorded, dict):
        raise ReplayError(f"{where}: its config must be a dict, got {type(recorded).__name__}")
    if str(recorded.get("peft_type", "LORA")) != "LORA":
        raise ReplayError(f"{where} is a {recorded.get('peft_type')} adapter: a replay rebuilds LoRA only; "
                          "record a 'factory' in the model spec for it")
    fields = {f.name for f in dataclasses.fields(lora_cls)}
    kwargs = {k: v for k, v in recorded.items() if k not in IGNORED_FIELDS and k != "peft_type"}
    unknown = sorted(k for k, v in kwargs.items() if k not in fields and v not in (None, {}, []))
    if unknown:
        raise ReplayError(f"{where} sets {unknown}, which this peft's LoraConfig does not have (recorded with peft "
                          f"{recorded.get('peft_version')}): install that version to replay it")
    kwargs = {k: v for k, v in kwargs.items() if k in fields}
    if kwargs.get("megatron_config") is not None:
        raise ReplayError(f"{where} is a Megatron LoRA (megatron_config): a replay does not rebuild it")
    if kwargs.get("init_lora_weights", True) not in PLAIN_INITS:
        raise ReplayError(f"{where} was initialised with init_lora_weights={kwargs['init_lora_weights']!r}, which "
                          f"reads the base or data; a replay rebuilds {list(PLAIN_INITS)} only")
    variants = sorted(k for k, v in kwargs.items() if k.endswith("_config") and k != "megatron_config" and v)
    if variants:
        raise ReplayError(f"{where} sets {variants}: a LoRA variant a replay does not rebuild")
    try:
        return lora_cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - LoraConfig's own validation, named
        raise ReplayError(f"{where}: LoraConfig(...) refused the recorded config: {type(e).__name__}: {e}") from e


def _pretrained(cls: Any, config: dict, base: dict, what: str) -> nn.Module:
    """The base ``from_pretrained`` loads from the recorded source, once its config is the recorded one."""
    source, subfolder = base["pretrained"], base.get("subfolder")
    if not isinstance(source, str) or (subfolder is not None and not isinstance(subfolder, str)):
        raise ReplayError(f"{what}: the base's source must be a path or hub id, got {source!r} / {subfolder!r}")
    where = f"{source}" + (f" (subfolder {subfolder})" if subfolder else "")
    options = {"subfolder": subfolder, "local_files_only": True}
    local = os.path.join(source, subfolder or "", "config.json")
    try:  # a local folder's config read within vidstab's bounds; a hub id's from the local cache
        on_disk = read_json_file(local) if os.path.isfile(local) else cls.load_config(source, **options)
        if not isinstance(on_disk, dict):
            raise ValueError("not a JSON object")
    except Exception as e:  # noqa: BLE001 - a missing folder, a cache without it, a damaged file: named
        raise ReplayError(f"{what} was fine-tuned over the base at {where}, which cannot be read here "
                          f"({type(e).__name__}: {str(e)[:300]}); replay on the machine that has it") from e
    differ = sorted(k for k, v in on_disk.items() if not k.startswith("_") and k in config and plain_json(v) != config[k])
    if differ:
        raise ReplayError(f"the base at {where} is not the one the run trained over: its config differs in {differ[:5]}")
    try:
        return cls.from_pretrained(source, use_safetensors=True, **options)
    except Exception as e:  # noqa: BLE001 - diffusers' own refusals (no safetensors file, a damaged one): named
        raise ReplayError(f"loading the base from {where} failed: {type(e).__name__}: {str(e)[:300]}") from e


def _dtype(name: Any, what: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ReplayError(f"{what}: {name!r} is not a floating-point dtype ({', '.join(DTYPES)})")
    return getattr(torch, name)
