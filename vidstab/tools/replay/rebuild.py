"""Rebuilding the model and loss a bundle names (trusted imports only) and loading its checkpoint."""

from __future__ import annotations

import contextvars
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ...evidence.capture import Incident, weights_entry
from ...checkpoint import CheckpointError, verify_checkpoint_files
from ...checkpoint.dcp_backend import DCP_DIR, SHARDED_INDEX
from ...checkpoint.frozen import FROZEN_KEY, fingerprint, read_header_metadata
from ...checkpoint.layout import read_manifest
from ...files.limits import env_name, limits, read_json_file
from ..trusted_import import ImportPathError, UntrustedImportError, resolve
from .base import ReplayError, UntrustedCodeError

_STATE_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")
MAX_HEADER = 100 * 1024 * 1024  # a safetensors header is JSON; anything larger is not one of ours


def import_object(path: str, what: str, kind: str = "callable") -> Any:
    """The object a bundle names, through the trusted resolver (:mod:`vidstab.tools.trusted_import`).

    Raises :class:`UntrustedCodeError` (nothing imported) when the user has not trusted it, and
    :class:`ReplayError` when it cannot be imported.
    """
    try:
        return resolve(path, what, kind=kind, how_to_allow="vidstab replay BUNDLE --trust {module} "
                                                         "(or replay(..., trust=['{module}']))")
    except UntrustedImportError as err:
        raise UntrustedCodeError(str(err)) from err
    except ImportPathError as err:
        raise ReplayError(str(err)) from err


#: The parameter cap of the replay now running (``replay(..., max_params=)``); None: ``Limits.params``.
MAX_PARAMS: contextvars.ContextVar[int | None] = contextvars.ContextVar("vidstab_replay_max_params", default=None)


def _check_size(spec: dict, what: str) -> None:
    """Build the model the spec names on the meta device (no memory for weights) and refuse it when it has
    more parameters than the cap, before it is built for real. A model that cannot be built on the meta
    device is counted after its real build instead."""
    import torch

    cap = MAX_PARAMS.get() or limits().params
    try:
        with torch.device("meta"):
            shape_only = _build(spec)
    except ReplayError:
        raise
    except Exception:  # noqa: BLE001 - a constructor that needs real tensors: counted after the real build
        return
    _refuse_if_over(sum(p.numel() for p in shape_only.parameters()), cap, what)


def _refuse_if_over(count: int, cap: int, what: str) -> None:
    if count > cap:
        raise ReplayError(f"{what} has {count:,} parameters, more than the {cap:,} a replay builds "
                          f"({env_name('params')}, or vidstab replay --max-params N / replay(..., max_params=N)); "
                          f"refused before allocating its weights (about {count * 4 / 2**30:.1f} GiB in fp32)")


def build_model(spec: dict | None) -> nn.Module:
    """Rebuild a model from a bundle's ``model`` spec (``class`` + ``config`` or ``factory`` + ``kwargs``).

    Only trusted code is imported (see :func:`import_object`); an untrusted name raises before anything runs.
    A model with more parameters than the cap (``MAX_PARAMS``, else ``vidstab.files.limits.Limits.params``) is
    refused before its weights are allocated.
    """
    import torch

    if isinstance(spec, dict) and spec and torch.empty(0).device.type != "meta":
        _check_size(spec, f"the model the bundle names ({spec.get('class') or spec.get('factory')})")
    model = _build(spec)
    _refuse_if_over(sum(p.numel() for p in model.parameters()), MAX_PARAMS.get() or limits().params,
                    f"the model the bundle names ({spec.get('class') or spec.get('factory')})")
    return model


def _build(spec: dict | None) -> nn.Module:
    if not spec:
        raise ReplayError(
            "the bundle has no model spec ('model' is null in incident.json), so the model cannot be rebuilt. "
            "Record one when attaching the guard: model_spec={'class': 'module:Class', 'config': {...}} "
            "(a diffusers ConfigMixin) or {'factory': 'module:function', 'kwargs': {...}}, plus 'loss_fn'."
        )
    if "class" in spec:
        cls = import_object(spec["class"], "model.class", kind="model_class")
        if not callable(getattr(cls, "from_config", None)):
            raise ReplayError(
                f"model.class {spec['class']!r} is not a diffusers ConfigMixin (it has no from_config); "
                f"record a 'factory' + 'kwargs' for it instead"
            )
        config = spec.get("config")
        if not isinstance(config, dict):
            raise ReplayError(f"model spec for {spec['class']!r} has no 'config' dict to rebuild it from")
        if "peft" in spec:  # a LoRA fine-tune: its base as the run loaded it, plus the recorded adapters
            from .adapters import build_with_adapters

            return _module(build_with_adapters(cls, config, spec["peft"], f"model.peft of {spec['class']}"))
        try:
            model = cls.from_config(config)
        except Exception as e:  # the user's constructor: report whatever it raises
            raise ReplayError(f"{spec['class']}.from_config(...) failed: {type(e).__name__}: {e}") from e
    elif "factory" in spec:
        factory = import_object(spec["factory"], "model.factory")
        kwargs = spec.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ReplayError(f"model.kwargs must be a dict, got {type(kwargs).__name__}")
        try:
            model = factory(**kwargs)
        except Exception as e:
            raise ReplayError(f"{spec['factory']}(**kwargs) failed: {type(e).__name__}: {e}") from e
    else:
        raise ReplayError(f"model spec has neither 'class' nor 'factory': {sorted(spec)}")
    return _module(model)


def _module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ReplayError(f"the model spec built a {type(model).__name__}, not a torch.nn.Module")
    return model


def _resolve_checkpoint(inc: Incident, override: str | os.PathLike | None) -> tuple[Path | None, int | None, list[str]]:
    """The weights file to load, its step, and notes. Raises when a named checkpoint is missing or corrupt."""
    notes: list[str] = []
    if override is not None:
        p = Path(override)
        origin = "--checkpoint"
    elif inc.meta.get("checkpoint"):
        p = Path(inc.meta["checkpoint"])
        if not p.is_absolute():
            p = inc.run_dir / p
        origin = f"the bundle's checkpoint {inc.meta['checkpoint']!r}"
    else:
        return None, None, notes
    if not p.exists():
        raise ReplayError(
            f"checkpoint missing: {origin} resolves to {p}, which does not exist "
            f"(the run folder is taken as {inc.run_dir}); pass --checkpoint PATH to point at the weights"
        )
    ckpt_dir = p if p.is_dir() else p.parent
    weights = p / "model.safetensors" if p.is_dir() else p
    if p.is_dir() and not weights.is_file() and (p / SHARDED_INDEX).is_file():
        return _resolve_sharded(inc, p, origin, override is None)
    if not weights.is_file():
        raise ReplayError(f"checkpoint missing: {origin} has no model.safetensors ({weights} does not exist)")
    step = None
    manifest_path = ckpt_dir / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = read_json_file(manifest_path)
            if not isinstance(manifest, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise ReplayError(f"{manifest_path} is corrupt (not valid JSON: {e})") from e
        step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
        files = manifest.get("files")
        if isinstance(files, dict) and weights.name in files:
            # Size and checksum (crc32 or sha256, whichever the manifest records) as the loader checks them.
            try:
                verify_checkpoint_files(ckpt_dir, [weights.name])
            except CheckpointError as e:
                raise ReplayError(f"{weights} is corrupt (checked against {manifest_path}): {e}") from e
            recorded = inc.meta.get("checkpoint_weights")
            if override is None and isinstance(recorded, dict) and recorded != files[weights.name]:
                raise ReplayError(
                    f"{origin} was rewritten after the incident: its {weights.name} is not the one the bundle "
                    f"recorded ({recorded} then, {files[weights.name]} now; a rollback saved that step again?), so a "
                    "replay would run other weights; pass --checkpoint PATH to replay on weights you choose")
    elif p.is_dir():
        notes.append(f"{ckpt_dir} has no manifest.json (written last): the checkpoint may be incomplete")
    if step is None:
        m = re.search(r"step_?(\d+)", ckpt_dir.name)
        step = int(m.group(1)) if m else None
    return weights, step, notes


def _resolve_sharded(inc: Incident, ckpt_dir: Path, origin: str, named_by_bundle: bool) -> tuple[Path, int | None, list[str]]:
    """A sharded (DCP, FSDP2) checkpoint: its shards folder, once every file the model is read from is checked
    against the manifest and, for the checkpoint the bundle names, the shards are the ones it recorded."""
    try:
        manifest = read_manifest(str(ckpt_dir))
        names = [f for f in manifest["files"] if f == SHARDED_INDEX or f.startswith(DCP_DIR + "/")]
        verify_checkpoint_files(ckpt_dir, names)
    except CheckpointError as e:
        raise ReplayError(f"{origin} ({ckpt_dir}) cannot be used: {e}") from e
    recorded, now = inc.meta.get("checkpoint_weights"), weights_entry(ckpt_dir)
    if named_by_bundle and isinstance(recorded, dict) and recorded != now:
        raise ReplayError(
            f"{origin} was rewritten after the incident: its shards are not the ones the bundle recorded (a "
            "rollback saved that step again?), so a replay would run other weights; pass --checkpoint PATH to "
            "replay on weights you choose")
    step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
    return ckpt_dir / DCP_DIR, step, []


def _load_sharded_weights(model: nn.Module, shards: Path) -> None:
    """Load the model's parameters from DCP shards written by any number of ranks into this one plain model
    (DCP reshards: each parameter is assembled from every rank's slice), in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        index = read_json_file(shards.parent / SHARDED_INDEX)["keys"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReplayError(f"{shards.parent / SHARDED_INDEX} is unreadable ({e})") from None
    own = model.state_dict()
    objects = {e["object"] for e in index.values()}
    name = next((o for o in sorted(objects) if {k[len(o) + 1:] for k, e in index.items() if e["object"] == o} == set(own)), None)
    if name is None:
        raise ReplayError(f"the weights in {shards.parent} do not fit the rebuilt model: no saved object has exactly "
                          f"its parameters {sorted(own)[:5]} (saved: {sorted(index)[:5]})")
    state = {f"{name}.{k}": v for k, v in own.items()}
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(shards)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP raises CheckpointException, RuntimeError, ValueError alike
        raise ReplayError(f"the sharded weights in {shards} could not be read: {type(e).__name__}: {str(e)[:600]}") from e
    model.load_state_dict({k: state[f"{name}.{k}"] for k in own}, strict=True)


def _frozen_fingerprint(weights: Path) -> dict | None:
    """The frozen parameters' fingerprint a checkpoint's model file records in its header (a LoRA / partially
    frozen model's checkpoint holds only what training changed: :mod:`vidstab.checkpoint.frozen`), or None."""
    try:
        with open(weights, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:
                return None
            meta = read_header_metadata(struct.pack("<Q", n) + f.read(n))
    except (OSError, struct.error, ValueError):
        return None  # load_file below names a damaged file
    raw = meta.get(FROZEN_KEY)
    try:
        saved = json.loads(raw) if raw else None
    except ValueError as e:
        raise ReplayError(f"{weights}: the frozen weights' fingerprint in its header is not JSON ({e})") from e
    return saved if isinstance(saved, dict) else None


def _load_weights(model: nn.Module, weights: Path) -> str | None:
    """Load the checkpoint's weights into the rebuilt model. A frozen-base checkpoint (only the trained
    parameters, plus a fingerprint of the frozen ones) is loaded over the base the model spec's factory
    rebuilt, once that base's fingerprint matches the one recorded; returns a note saying so (else None)."""
    if weights.is_dir():
        return _load_sharded_weights(model, weights)
    frozen = _frozen_fingerprint(weights)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ReplayError(f"{weights} is corrupt or truncated ({type(e).__name__}: {e})") from e
    own = set(model.state_dict())
    if not set(state) & own:  # keys saved through a wrapper (DDP, torch.compile, FSDP): strip its prefix
        for prefix in _STATE_PREFIXES:
            state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    note = None
    if frozen is not None:
        note = _check_rebuilt_base(model, weights, frozen, set(state))
    try:
        missing, unexpected = model.load_state_dict(state, strict=frozen is None)
    except RuntimeError as e:
        raise ReplayError(f"the weights in {weights} do not fit the rebuilt model: {str(e)[:600]}") from e
    if frozen is not None and (unexpected or set(missing) - set(frozen.get("keys") or [])):
        raise ReplayError(f"the weights in {weights} do not fit the rebuilt model: missing "
                          f"{sorted(set(missing) - set(frozen.get('keys') or []))[:5]}, unexpected {sorted(unexpected)[:5]}")
    return note


def _check_rebuilt_base(model: nn.Module, weights: Path, saved: dict, trained: set[str]) -> str:
    """The rebuilt model's frozen (base) weights are the ones the run trained its adapters against: the
    parameters the checkpoint leaves out, fingerprinted as the run did. Raises naming what differs."""
    keys = sorted(saved.get("keys") or [])
    params = dict(model.named_parameters(remove_duplicate=False))
    absent = [k for k in keys if k not in params]
    if absent:
        raise ReplayError(f"{weights} was trained over frozen parameters the rebuilt model does not have "
                          f"({absent[:5]}): the model spec's factory builds another base model")
    overlap = sorted(set(keys) & trained)
    if overlap:
        raise ReplayError(f"{weights} both holds and fingerprints {overlap[:5]}: the checkpoint is inconsistent")
    now = fingerprint(model, keys)
    if (now["crc32"], now["bytes"]) != (saved.get("crc32"), saved.get("bytes")):
        raise ReplayError(
            f"the base the model spec's factory rebuilt is not the one the run trained on: its {len(keys)} frozen "
            f"tensors fingerprint {now['crc32']} ({now['bytes']} bytes), the checkpoint {weights} recorded "
            f"{saved.get('crc32')} ({saved.get('bytes')} bytes). Make the factory load the same base model (and "
            "revision) the run used")
    return (f"frozen-base checkpoint: {len(trained)} trained tensor(s) loaded over the rebuilt base, "
            f"whose {len(keys)} frozen tensor(s) match the recorded fingerprint {now['crc32']}")
