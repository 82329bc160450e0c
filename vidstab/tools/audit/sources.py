"""Where audited samples come from: a folder of safetensors shards (format-neutral), or videos decoded by
a reader the caller injects. This package reads no trainer's own cache format and imports no trainer code."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ...files.limits import loads_bounded, read_json_file
from .data import audit_tensors
from .findings import _IDS_IN_MESSAGE, finding


#: ``reader(data_dir, num_frames, resolution) -> (rows, skipped)``: rows are ``{"sample_id", "video"}`` with
#: ``video`` a ``[T, 3, H, W]`` tensor in ``[-1, 1]``; ``skipped`` lists ``{"sample_id", "reason"}`` for files
#: that cannot be used (``vidstab.reference.data.video_folder_dataset`` with ``skip_bad_samples=True`` fits).
VideoReader = Callable[[Path, int, int], tuple[Iterable[Mapping[str, Any]], list[dict]]]


def iter_latent_cache(cache_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(sample_id, latent)`` from a folder of safetensors shards, one shard in memory at a time.

    Format-neutral: every ``*.safetensors`` file in the folder, in name order, holding a ``latents`` tensor
    ``[N, ...]`` (or a single tensor). Sample ids come from a sibling ``<shard>.json`` (``{"sample_ids": [...]}``
    or a plain list), else the shard's safetensors metadata (``sample_ids`` as a JSON string), else a
    ``sample_ids`` list in ``manifest.json`` in shard order (the reference cache writes one), else
    ``<shard>:<index>``. A file that is not a readable safetensors shard raises ``ValueError`` naming it.
    """
    from safetensors import SafetensorError, safe_open  # local import: only the cache reader needs it

    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise FileNotFoundError(f"latent cache {str(cache_dir)!r} is not a folder")
    shards = sorted(cache_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors shards in latent cache {str(cache_dir)!r}")
    manifest_ids = _manifest_ids(cache_dir / "manifest.json")

    offset = 0
    for path in shards:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
                key = "latents" if "latents" in keys else (keys[0] if len(keys) == 1 else None)
                if key is None:
                    raise KeyError(f"{path.name}: no 'latents' tensor (keys: {keys})")
                latents = f.get_tensor(key)
                metadata = f.metadata() or {}
        except (SafetensorError, OSError, RuntimeError) as err:  # truncated, garbage, unreadable
            raise ValueError(f"shard {path.name} is not a readable safetensors file ({type(err).__name__}: {err})") from err
        ids = _shard_ids(path, metadata)
        if ids is None and manifest_ids is not None:
            ids = manifest_ids[offset : offset + latents.shape[0]]
        if ids is None or len(ids) != latents.shape[0]:
            ids = [f"{path.stem}:{i}" for i in range(latents.shape[0])]
        offset += latents.shape[0]
        for sample_id, latent in zip(ids, latents):
            yield sample_id, latent


def _manifest_ids(path: Path) -> list[str] | None:
    """A top-level ``sample_ids`` list of ``manifest.json``, if the folder has one."""
    if not path.is_file():
        return None
    try:
        manifest = read_json_file(path, path.name)
    except ValueError as err:
        raise ValueError(f"{path.name} is not valid JSON ({err})") from err
    ids = manifest.get("sample_ids") if isinstance(manifest, dict) else None
    return [str(i) for i in ids] if isinstance(ids, list) else None


def _shard_ids(path: Path, metadata: dict) -> list[str] | None:
    """Sample ids for one shard from its sibling JSON or its safetensors metadata, if either has them."""
    sibling = path.with_suffix(".json")
    if sibling.is_file():
        data = read_json_file(sibling, sibling.name)
        ids = data.get("sample_ids") if isinstance(data, dict) else data
        if isinstance(ids, list):
            return [str(i) for i in ids]
    if "sample_ids" in metadata:
        try:
            return [str(i) for i in loads_bounded(metadata["sample_ids"], f"{path.name} metadata sample_ids")]
        except ValueError:
            return None
    return None


def audit_latent_cache(cache_dir: str | Path, *, reader: Callable[[Path], Iterable[tuple[str, torch.Tensor]]] | None = None,
                       **kwargs: Any) -> list[dict]:
    """:func:`audit_tensors` over a latent cache folder; ``check`` names start with ``latents.``.

    ``reader(cache_dir)`` yields ``(sample_id, latent)``; default :func:`iter_latent_cache` (a folder of
    safetensors shards). An unreadable cache is a blocking ``latents.read`` finding naming the file, rather
    than an exception (the command line exits 2 for it).
    """
    read = reader or iter_latent_cache
    try:
        return audit_tensors(read(Path(cache_dir)), name="latents", **kwargs)
    except (OSError, KeyError, ValueError) as err:
        return [finding("latents.read", "block", f"cannot read latent cache {str(cache_dir)!r}: {err}")]


def audit_video_folder(data_dir: str | Path, reader: VideoReader, num_frames: int = 16, resolution: int = 64,
                       **kwargs: Any) -> list[dict]:
    """Decode every video under ``data_dir`` with ``reader`` (see :data:`VideoReader`) and audit the clips.

    Files that cannot be decoded are blocking findings (``data.decode``) naming each file; the clips
    ``[T, 3, H, W]`` in ``[-1, 1]`` are scanned by :func:`audit_tensors` with frames on axis 0. The decoder
    is injected (the command line passes the reference data loader's), so the audit imports no trainer code.
    """
    try:
        ds, skipped = reader(Path(data_dir), num_frames, resolution)
    except (OSError, ValueError) as err:
        return [finding("data.decode", "block", f"cannot load videos from {str(data_dir)!r}: {err}")]
    findings = []
    if skipped:
        ids = [s["sample_id"] for s in skipped]
        findings.append(finding(
            "data.decode", "block",
            f"{len(skipped)} videos cannot be used: "
            + "; ".join(f"{s['sample_id']}: {s['reason']}" for s in skipped[:_IDS_IN_MESSAGE]),
            sample_ids=ids, skipped=skipped,
        ))
    kwargs.setdefault("frame_dim", 0)
    samples = ((row["sample_id"], row["video"]) for row in ds)
    return findings + audit_tensors(samples, name="data", **kwargs)
