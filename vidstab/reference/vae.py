"""The reference trainer's VAE and its latent cache.

The DiT trains on VAE latents, not pixels. Encoding is the expensive, deterministic part, so every video is
encoded once into a *latent cache* on disk and training reads from that:

1. :func:`build_vae` gives a diffusers ``AutoencoderKLWan``: a tiny, seeded, random-init one by default (fast
   on CPU, for tests and drills) or a pretrained one from a local diffusers folder.
2. :func:`encode_to_cache` encodes a video data set (see :mod:`vidstab.reference.data`), normalises the
   latents per channel, optionally clamps them, logs their statistics (the VAE is a classic hidden source of
   extreme values that later turn the loss into inf), and writes safetensors shards plus ``manifest.json``.
   A cache whose fingerprint matches is reused; a changed data set, VAE, normalisation or clamp, or a
   damaged shard, rebuilds it.
3. :class:`LatentCache` is a torch ``Dataset`` over the cached latents; :func:`collate_latents` batches them.

Frame-count rule: Wan's encoder reads the first frame alone and then chunks of 4 frames, each becoming one
latent frame, and *silently drops* leftover frames. So videos must have ``T = 1 + 4k`` frames (1, 5, 9, 17,
...) and give ``1 + k`` latent frames; height and width must be multiples of 8. The latent of a
``[3, T, H, W]`` video is ``[C, 1 + (T - 1) // 4, H // 8, W // 8]`` (see :func:`latent_shape`).
:func:`encode_to_cache` refuses other sizes with a clear error instead of losing frames.

In multi-process runs, build the cache on the main process first (``with accelerator.main_process_first():``)
so the other ranks find it ready and only load it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vidstab.files.atomic import atomic_folder
from vidstab.files.limits import read_json_file
from vidstab.reference.data import BadSampleError, collate_videos, validate_video

__all__ = [
    "CACHE_FORMAT",
    "LatentCache",
    "LatentCacheError",
    "build_vae",
    "collate_latents",
    "encode_to_cache",
    "latent_shape",
    "tiny_wan_vae_config",
    "vae_fingerprint",
]

#: Version of the on-disk cache layout; part of the fingerprint so a layout change rebuilds old caches.
CACHE_FORMAT = 1
#: Upper bound on the size of one shard file.
SHARD_BYTES = 64 * 2**20
#: How many of the most extreme samples the statistics name.
_TOP_EXTREME = 5


# ----------------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------------


def tiny_wan_vae_config(latent_channels: int = 4) -> dict:
    """Config of a tiny ``AutoencoderKLWan`` (~0.2 M parameters) that encodes a 9x32x32 clip in ~10 ms on CPU.

    Same architecture and compression as Wan 2.1's VAE (8x spatial, 4x temporal with the first frame alone),
    only narrower (``base_dim=8``) and shallower (one residual block per level). ``latents_mean`` and
    ``latents_std`` are ``None``: a random-init VAE has no known latent statistics, so the cache measures them.
    """
    return {
        "base_dim": 8,
        "z_dim": latent_channels,
        "dim_mult": [1, 2, 2, 2],  # three downsampling levels -> H / 8, W / 8
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],  # two temporal halvings -> 1 + (T - 1) / 4 frames
        "dropout": 0.0,
        "latents_mean": None,
        "latents_std": None,
    }


def build_vae(vae_path: str | os.PathLike | None, seed: int, latent_channels: int = 4):
    """The VAE for the reference trainer, in eval mode with gradients off.

    - ``vae_path=None``: a tiny random-init ``AutoencoderKLWan`` (:func:`tiny_wan_vae_config`) whose weights
      depend only on ``seed`` (the global torch RNG is left untouched).
    - otherwise a local diffusers folder holding an ``AutoencoderKLWan`` (``config.json`` + weights), or a
      pipeline folder with a ``vae/`` sub-folder. Nothing is downloaded. ``latent_channels`` is ignored: the
      pretrained config's ``z_dim`` decides. Raises ``FileNotFoundError``/``ValueError`` with the reason when
      the folder is missing or does not hold a Wan VAE.
    """
    from diffusers import AutoencoderKLWan  # heavy import, only when a VAE is actually needed

    if vae_path is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            vae = AutoencoderKLWan(**tiny_wan_vae_config(latent_channels))
    else:
        folder = Path(vae_path)
        if not folder.is_dir():
            raise FileNotFoundError(f"VAE folder {str(folder)!r} does not exist (expected a local diffusers folder)")
        subfolder = None
        if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
            subfolder = "vae"  # a whole pipeline folder: use its VAE
        config_file = folder / (subfolder or "") / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{str(folder)!r} is not a diffusers VAE folder: no config.json (nor vae/config.json)")
        try:
            class_name = json.loads(config_file.read_text()).get("_class_name")
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the VAE config {str(config_file)!r}: {exc}") from exc
        if class_name != "AutoencoderKLWan":
            raise ValueError(
                f"{str(config_file)!r} describes a {class_name!r}, not an AutoencoderKLWan; the reference "
                "trainer needs a Wan VAE"
            )
        try:
            vae = AutoencoderKLWan.from_pretrained(str(folder), subfolder=subfolder, local_files_only=True)
        except Exception as exc:  # diffusers raises several kinds (missing weights, bad shapes, ...)
            raise ValueError(f"cannot load the Wan VAE from {str(folder)!r}: {type(exc).__name__}: {exc}") from exc
    vae.eval().requires_grad_(False)
    return vae


def _compression(vae) -> tuple[int, int]:
    """(temporal chunk, spatial factor) of a Wan VAE: 4 frames per latent frame, 2 per downsampling level."""
    spatial = 2 ** (len(vae.config.dim_mult) - 1) * (vae.config.patch_size or 1)
    return 4, spatial  # the chunk of 4 is hard-coded in AutoencoderKLWan._encode


def latent_shape(vae, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """Shape ``(C, T', H', W')`` of one video's latent; raises ``ValueError`` for sizes Wan cannot encode exactly."""
    chunk, spatial = _compression(vae)
    if num_frames < 1 or (num_frames - 1) % chunk:
        raise ValueError(
            f"a Wan VAE needs T = 1 + {chunk}k frames (1, 5, 9, 17, ...), got {num_frames}: the encoder would "
            f"silently drop the last {(num_frames - 1) % chunk} frames. "
            f"Use num_frames={1 + (num_frames - 1) // chunk * chunk} or {1 + ((num_frames - 1) // chunk + 1) * chunk}"
        )
    if height % spatial or width % spatial:
        raise ValueError(
            f"a Wan VAE with this config needs height and width divisible by {spatial}, got {height}x{width}"
        )
    return (int(vae.config.z_dim), 1 + (num_frames - 1) // chunk, height // spatial, width // spatial)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor of any dtype (bf16 has no numpy equivalent, so go through uint8)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def vae_fingerprint(vae) -> str:
    """SHA-256 of the VAE's config (without diffusers' bookkeeping keys like ``_name_or_path``) and weights."""
    h = hashlib.sha256()
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(vae.state_dict().items()):
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}".encode())
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# Reading the data set
# ----------------------------------------------------------------------------------------------------


def _video_batches(dataset: Any, batch_size: int) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Yield ``(sample_ids, videos [B, T, 3, H, W])`` from a ``datasets.Dataset`` or any indexable of dicts."""
    datasets = sys.modules.get("datasets")  # a Dataset exists only once the library is imported: no import for others

    if datasets is not None and isinstance(dataset, datasets.Dataset):
        ds = dataset.with_format("torch", columns=["sample_id", "video"])
        for start in range(0, len(ds), batch_size):
            batch = ds[start : start + batch_size]
            video = batch["video"]
            if not isinstance(video, torch.Tensor):  # ragged shapes come back as a list
                video = torch.stack([torch.as_tensor(v) for v in video])
            yield [str(s) for s in batch["sample_id"]], video.float()
    else:
        for start in range(0, len(dataset), batch_size):
            batch = collate_videos([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            yield batch["sample_ids"], batch["video"].float()


def _data_fingerprint(dataset: Any, batch_size: int) -> tuple[str, list[str], tuple[int, ...]]:
    """Content hash of the data set (ids, shapes and every value), its sample ids, and the video shape.

    Also validates every video (shape, finiteness, one shape for all), so encoding never starts on bad data.
    Hashing the values is cheap next to encoding them, and unlike a file listing it sees any change.
    """
    h = hashlib.sha256()
    ids: list[str] = []
    shape: tuple[int, ...] | None = None
    for batch_ids, videos in _video_batches(dataset, batch_size):
        for sample_id, video in zip(batch_ids, videos):
            if shape is None:
                shape = tuple(video.shape)
            validate_video(video, sample_id, shape[0])
            if tuple(video.shape) != shape:
                raise BadSampleError(
                    sample_id, f"shape {list(video.shape)} differs from the first video's {list(shape)}"
                )
            h.update(sample_id.encode() + b"\0")
            h.update(_tensor_bytes(video))
            ids.append(sample_id)
    if shape is None:
        raise ValueError("cannot build a latent cache from an empty data set")
    if len(set(ids)) != len(ids):
        dupes = sorted({s for s in ids if ids.count(s) > 1})[:5]
        raise ValueError(f"sample ids must be unique, repeated: {dupes}")
    h.update(json.dumps(list(shape)).encode())
    return h.hexdigest(), ids, shape


# ----------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------


def denormalize_latents(latents: torch.Tensor, normalization: dict) -> torch.Tensor:
    """Undo ``z = (latent - mean) / std`` per channel (``normalization`` as in a cache manifest)."""
    shape = (-1, 1, 1, 1)
    mean = torch.tensor(normalization["mean"], dtype=latents.dtype, device=latents.device).view(shape)
    std = torch.tensor(normalization["std"], dtype=latents.dtype, device=latents.device).view(shape)
    return latents * std + mean


class LatentCacheError(RuntimeError):
    """A latent cache folder that is missing, incomplete or damaged (the message says which file and how)."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class LatentCache(torch.utils.data.Dataset):
    """Normalised VAE latents of a video data set, read lazily from a cache folder of safetensors shards.

    ``cache[i]`` is ``{"latents": Tensor[C, T', H', W'] float32, "sample_id": str}``, read from its shard with
    ``safetensors.safe_open`` (a memory-mapped slice): memory does not grow with the data set. Build or reuse
    one with :func:`encode_to_cache`; open an existing one with :meth:`LatentCache.load`.
    """

    def __init__(self, cache_dir: Path, manifest: dict, rebuilt: bool):
        #: The cache folder.
        self.cache_dir = Path(cache_dir)
        #: The parsed ``manifest.json``.
        self.manifest = manifest
        #: Sample ids in cache order (the data set's order).
        self.sample_ids: list[str] = list(manifest["sample_ids"])
        #: True when this call encoded the data set, False when it reused the cache on disk.
        self.rebuilt = rebuilt
        self._files = [self.cache_dir / shard["file"] for shard in manifest["shards"]]
        self._starts = list(itertools.accumulate((shard["num_samples"] for shard in manifest["shards"]), initial=0))
        self._handles: dict[int, Any] = {}  # shard index -> open safe_open handle (per process: see __getstate__)

    def __getstate__(self) -> dict:
        # DataLoader workers get a copy without open handles; each opens its own.
        return {**self.__dict__, "_handles": {}}

    @property
    def fingerprint(self) -> str:
        """Hash of everything the cache depends on (data, VAE, normalisation, clamp, dtype, layout)."""
        return self.manifest["fingerprint"]

    @property
    def stats(self) -> dict:
        """Latent statistics measured at encode time (per channel, raw and normalised; extremes; non-finite)."""
        return self.manifest["stats"]

    @property
    def normalization(self) -> dict:
        """``{"source": "config" | "measured", "mean": [...], "std": [...]}``: ``z = (latent - mean) / std``."""
        return self.manifest["normalization"]

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one sample's latents, ``(C, T', H', W')``."""
        return tuple(self.manifest["latent_shape"])

    @property
    def latents(self) -> torch.Tensor:
        """Every sample's latents ``[N, C, T', H', W']`` in memory at once: for small caches and tests only."""
        if not self._files:
            return torch.empty((0, *self.latent_shape))
        return torch.cat([load_file(str(path))["latents"].float() for path in self._files])

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample_id(self, index: int) -> str:
        """The id of sample ``index``, without reading its latents (:class:`vidstab.QuarantinedDataset`)."""
        return self.sample_ids[index]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a latent cache of {len(self)} samples")
        shard = bisect.bisect_right(self._starts, index) - 1
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self._files[shard]), framework="pt")
        row = self._handles[shard].get_slice("latents")[index - self._starts[shard]]
        return {"latents": row.float(), "sample_id": self.sample_ids[index]}

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Undo the normalisation (``latents [..., C, T', H', W']`` -> VAE latents), e.g. before ``vae.decode``."""
        return denormalize_latents(latents, self.normalization)

    @classmethod
    def load(cls, cache_dir: str | os.PathLike, *, verify: bool = True) -> LatentCache:
        """Open a cache folder; with ``verify`` each shard's size and SHA-256 are checked against the manifest.

        Every shard's header (shape) is checked; the values are read only when items are. Raises
        :class:`LatentCacheError` naming the missing or damaged file.
        """
        cache_dir = Path(cache_dir)
        manifest_path = cache_dir / "manifest.json"
        if not manifest_path.is_file():
            raise LatentCacheError(f"no manifest.json in {str(cache_dir)!r}")
        try:
            manifest = read_json_file(manifest_path)
            shards = manifest["shards"]
            n, shape = len(manifest["sample_ids"]), tuple(manifest["latent_shape"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LatentCacheError(f"unreadable manifest {str(manifest_path)!r}: {exc}") from exc
        total = 0
        for shard in shards:
            path = cache_dir / shard["file"]
            if not path.is_file():
                raise LatentCacheError(f"shard {shard['file']} is missing from {str(cache_dir)!r}")
            if verify:
                size = path.stat().st_size
                if size != shard["bytes"]:
                    raise LatentCacheError(
                        f"shard {shard['file']} has {size} bytes, the manifest says {shard['bytes']}"
                    )
                if _sha256_file(path) != shard["sha256"]:
                    raise LatentCacheError(f"shard {shard['file']} does not match its SHA-256 in the manifest")
            try:
                with safe_open(str(path), framework="pt") as f:
                    stored = tuple(f.get_slice("latents").get_shape())
            except Exception as exc:  # safetensors raises its own error types for damaged headers
                raise LatentCacheError(f"cannot read shard {shard['file']}: {type(exc).__name__}: {exc}") from exc
            if stored[1:] != shape or stored[0] != shard["num_samples"]:
                raise LatentCacheError(
                    f"shard {shard['file']} holds {list(stored)}, "
                    f"expected [{shard['num_samples']}, *{list(shape)}]"
                )
            total += stored[0]
        if total != n:
            raise LatentCacheError(f"shards hold {total} samples, the manifest lists {n}")
        return cls(cache_dir, manifest, rebuilt=False)


def collate_latents(items: Sequence[dict]) -> dict:
    """Stack cache items into ``{"latents": Tensor[B, C, T', H', W'], "sample_ids": list[str]}``."""
    return {
        "latents": torch.stack([item["latents"] for item in items]),
        "sample_ids": [item["sample_id"] for item in items],
    }


# ----------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------


def _resolve_normalization(vae, requested: str) -> str:
    """``"config"`` or ``"measured"`` for ``requested`` in ``{"auto", "config", "measured"}``.

    ``auto`` trusts the config's ``latents_mean``/``latents_std`` only for a VAE loaded from disk whose lists
    have ``z_dim`` entries: a random-init VAE's config values (diffusers' defaults are Wan 2.1's) describe
    some other VAE's latents.
    """
    z_dim = int(vae.config.z_dim)
    mean, std = vae.config.get("latents_mean"), vae.config.get("latents_std")
    usable = mean is not None and std is not None and len(mean) == z_dim and len(std) == z_dim
    if requested == "measured":
        return "measured"
    if requested == "config":
        if not usable:
            raise ValueError(
                f"normalization='config' needs latents_mean and latents_std with z_dim={z_dim} entries in the VAE "
                f"config, found {mean!r} and {std!r}"
            )
        return "config"
    if requested == "auto":
        pretrained = bool(vae.config.get("_name_or_path"))
        return "config" if pretrained and usable else "measured"
    raise ValueError(f"normalization must be 'auto', 'config' or 'measured', got {requested!r}")


def _channel_stats(latents: torch.Tensor) -> dict:
    """Per-channel min/max/mean/std of ``[N, C, ...]`` over finite values only (NaN/Inf are counted apart)."""
    x = latents.transpose(0, 1).reshape(latents.shape[1], -1).double()
    finite = torch.isfinite(x)
    count = finite.sum(1).clamp(min=1)
    zero = torch.zeros((), dtype=x.dtype)
    mean = torch.where(finite, x, zero).sum(1) / count
    var = torch.where(finite, (x - mean[:, None]) ** 2, zero).sum(1) / count
    big = torch.tensor(math.inf, dtype=x.dtype)
    return {
        "min": torch.where(finite, x, big).amin(1).tolist(),
        "max": torch.where(finite, x, -big).amax(1).tolist(),
        "mean": mean.tolist(),
        "std": var.sqrt().tolist(),
    }


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def _write_cache(cache_dir: Path, latents: torch.Tensor, manifest: dict) -> dict:
    """Write shards + manifest (last) into a temporary folder beside ``cache_dir``, then swap it in."""
    parent = cache_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    if cache_dir.exists() and any(cache_dir.iterdir()) and not (
        (cache_dir / "manifest.json").exists() or any(cache_dir.glob("latents-*.safetensors"))
    ):
        raise LatentCacheError(f"refusing to replace {str(cache_dir)!r}: it is not empty and not a latent cache")

    with atomic_folder(parent, cache_dir.name) as folder:
        tmp = folder.tmp
        per_sample = max(1, latents[0].numel() * latents.element_size())
        per_shard = max(1, SHARD_BYTES // per_sample)
        shards = []
        for index, start in enumerate(range(0, latents.shape[0], per_shard)):
            name = f"latents-{index:05d}.safetensors"
            chunk = latents[start : start + per_shard].contiguous()
            save_file({"latents": chunk}, str(tmp / name), metadata={"first_index": str(start)})
            shards.append(
                {"file": name, "num_samples": int(chunk.shape[0]), "bytes": (tmp / name).stat().st_size,
                 "sha256": _sha256_file(tmp / name)}
            )
        manifest = {**manifest, "shards": shards, "created": time.time()}
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def _try_reuse(cache_dir: Path, parts: dict, log: Callable[[str], None]) -> LatentCache | None:
    """The cache in ``cache_dir`` if it was built from exactly ``parts`` and verifies; else log why not."""
    manifest_path = cache_dir / "manifest.json"
    if not manifest_path.is_file():
        if cache_dir.exists():
            log(f"latent cache: {cache_dir} has no manifest (an unfinished build?); building")
        else:
            log(f"latent cache: building {cache_dir}")
        return None
    try:
        old_parts = json.loads(manifest_path.read_text())["fingerprint_parts"]
    except (OSError, ValueError, KeyError) as exc:
        log(f"latent cache: unreadable manifest in {cache_dir} ({exc}); rebuilding")
        return None
    changed = [key for key in parts if old_parts.get(key) != parts[key]]
    if changed:
        log(f"latent cache: {cache_dir} is stale ({', '.join(changed)} changed); rebuilding")
        return None
    try:
        cache = LatentCache.load(cache_dir)
    except LatentCacheError as exc:
        log(f"latent cache: {cache_dir} is damaged ({exc}); rebuilding")
        return None
    log(f"latent cache: reusing {cache_dir} ({len(cache)} samples, fingerprint {cache.fingerprint[:12]})")
    return cache


def _encode_latents(dataset: Any, vae, batch_size: int, device, dtype: torch.dtype) -> torch.Tensor:
    """VAE posterior means of every video, ``[N, C, T', H', W']`` float32 on the CPU, in data set order."""
    # Only cast when needed: diffusers warns about `.to(dtype)` even when it is a no-op.
    if vae.dtype != dtype:
        vae.to(dtype=dtype)
    vae.to(device=device).eval()
    parts = []
    with torch.inference_mode():
        for _, videos in _video_batches(dataset, batch_size):
            x = videos.to(device=device, dtype=dtype).permute(0, 2, 1, 3, 4)  # [B, T, 3, H, W] -> [B, 3, T, H, W]
            parts.append(vae.encode(x).latent_dist.mean.float().cpu())
    return torch.cat(parts)  # outside inference mode, so the result is an ordinary tensor


def encode_to_cache(
    dataset: Any,
    vae,
    cache_dir: str | os.PathLike,
    *,
    batch_size: int = 4,
    clamp: float | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] = print,
    normalization: str = "auto",
    allow_nonfinite: bool = False,
) -> LatentCache:
    """Encode every video of ``dataset`` once with ``vae`` into ``cache_dir``, or reuse the cache there.

    ``dataset``: a data set from :mod:`vidstab.reference.data` (or anything indexable whose items have
    ``sample_id`` and ``video [T, 3, H, W]`` in [-1, 1]). Videos need ``T = 1 + 4k`` frames and sides divisible
    by 8 (see :func:`latent_shape`).

    Each video's latent is the **mean of the VAE posterior** (``latent_dist.mean``), not a sample, so the cache
    depends only on the data and the weights; the trainer adds its own noise. Latents are then normalised per
    channel, ``z = (latent - mean) / std``, with ``normalization``:

    - ``"auto"`` (default): the VAE config's ``latents_mean``/``latents_std`` for a VAE loaded from disk whose
      lists have ``z_dim`` entries, otherwise ``"measured"``;
    - ``"config"``: the config's values (error if absent or of the wrong length);
    - ``"measured"``: per-channel mean/std of this data set's latents (so the cache has mean 0, std 1).

    ``clamp``: if set, normalised latents are clipped to ``[-clamp, clamp]`` (a guard against the extreme
    latents a VAE can give odd inputs); how many values were clipped, and in which samples, is logged.

    Statistics (per-channel min/max/mean/std before and after normalisation, non-finite count, the samples
    with the most extreme values) go to ``log`` and to ``manifest.json``. Non-finite latents raise
    :class:`BadSampleError` naming the samples, unless ``allow_nonfinite`` (fault drills) keeps them.

    The cache is reused when its fingerprint (data content + ids, VAE config + weights, normalisation,
    clamp, dtype, cache format) matches; otherwise, or when a shard is missing or damaged, it is rebuilt and
    ``log`` says why. The returned cache's ``rebuilt`` tells which happened. ``vae`` is moved to
    ``device``/``dtype``.
    """
    cache_dir = Path(cache_dir)
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be a positive number or None, got {clamp!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    source = _resolve_normalization(vae, normalization)

    data_hash, ids, video_shape = _data_fingerprint(dataset, batch_size)
    num_frames, _, height, width = video_shape
    lat_shape = latent_shape(vae, num_frames, height, width)
    # Everything the cached values depend on. Stored part by part, so a rebuild can say what changed.
    parts = {
        "format": CACHE_FORMAT,
        "data": data_hash,
        "vae": vae_fingerprint(vae),
        "normalization": source,
        "clamp": clamp,
        "dtype": str(dtype),
        "latent": "posterior_mean",
    }
    fingerprint = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    cache = _try_reuse(cache_dir, parts, log)
    if cache is not None:
        return cache

    started = time.time()
    raw = _encode_latents(dataset, vae, batch_size, device, dtype)
    seconds = time.time() - started
    if tuple(raw.shape[1:]) != lat_shape:  # a guard on our own shape rule
        raise RuntimeError(f"VAE returned latents {list(raw.shape[1:])}, expected {list(lat_shape)}")
    log(f"latent cache: encoded {len(ids)} videos {list(video_shape)} -> latents {list(lat_shape)} "
        f"(posterior mean) in {seconds:.1f}s")

    # Statistics of the raw VAE output.
    raw_stats = _channel_stats(raw)
    nonfinite_per_sample = (~torch.isfinite(raw)).flatten(1).sum(1)
    nonfinite = int(nonfinite_per_sample.sum())
    nonfinite_ids = [ids[i] for i in nonfinite_per_sample.nonzero().flatten().tolist()]
    log(f"latent stats (VAE output) per channel: min {_fmt(raw_stats['min'])} max {_fmt(raw_stats['max'])} "
        f"mean {_fmt(raw_stats['mean'])} std {_fmt(raw_stats['std'])}; non-finite values: {nonfinite}")
    if nonfinite:
        message = f"{nonfinite} non-finite latent values in {len(nonfinite_ids)} samples: {nonfinite_ids[:10]}"
        if not allow_nonfinite:
            raise BadSampleError(", ".join(nonfinite_ids[:10]), "the VAE produced non-finite latents: " + message)
        log("latent cache: WARNING " + message + " (kept: allow_nonfinite=True)")

    # Normalise.
    if source == "config":
        mean, std = list(map(float, vae.config.latents_mean)), list(map(float, vae.config.latents_std))
    else:
        mean = raw_stats["mean"]
        std = [s if s > 1e-6 else 1.0 for s in raw_stats["std"]]  # a constant channel is left unscaled
    view = (1, -1, 1, 1, 1)
    z = (raw - torch.tensor(mean).view(view)) / torch.tensor(std).view(view)
    log(f"latent cache: normalisation {'from the VAE config' if source == 'config' else 'measured on this data set'}: "
        f"mean {_fmt(mean)} std {_fmt(std)}")

    # The samples with the most extreme values, named so a bad video can be found before it hurts training.
    absmax = torch.nan_to_num(z, nan=math.inf).abs().flatten(1).amax(1)
    order = absmax.argsort(descending=True)[:_TOP_EXTREME].tolist()
    extreme = [{"sample_id": ids[i], "absmax": float(absmax[i])} for i in order]
    log("latent cache: most extreme samples (max |z|): "
        + ", ".join(f"{e['sample_id']} ({e['absmax']:.3g})" for e in extreme))

    clamped_values, clamped_ids = 0, []
    if clamp is not None:
        over = (z.abs() > clamp).flatten(1).sum(1)
        clamped_values = int(over.sum())
        clamped_ids = [ids[i] for i in over.nonzero().flatten().tolist()]
        z = z.clamp(-clamp, clamp)
        log(f"latent cache: clamped {clamped_values} values to +-{clamp:g} in {len(clamped_ids)} samples"
            + (f": {clamped_ids[:10]}" if clamped_ids else ""))
    z = z.float().contiguous()
    z_stats = _channel_stats(z)
    log(f"latent stats (normalised) per channel: min {_fmt(z_stats['min'])} max {_fmt(z_stats['max'])} "
        f"mean {_fmt(z_stats['mean'])} std {_fmt(z_stats['std'])}")

    manifest = {
        "schema": 1,
        "fingerprint": fingerprint,
        "fingerprint_parts": parts,
        "sample_ids": ids,
        "video_shape": list(video_shape),
        "latent_shape": list(lat_shape),
        "dtype": "float32",
        "latent": "posterior_mean",
        "normalization": {"source": source, "mean": mean, "std": std},
        "clamp": clamp,
        "vae": {"class": type(vae).__name__, "name_or_path": vae.config.get("_name_or_path"),
                "z_dim": int(vae.config.z_dim)},
        "stats": {
            "num_samples": len(ids),
            "raw": raw_stats,
            "normalized": z_stats,
            "nonfinite": nonfinite,
            "nonfinite_sample_ids": nonfinite_ids,
            "clamped_values": clamped_values,
            "clamped_sample_ids": clamped_ids,
            "extreme_samples": extreme,
            "encode_seconds": seconds,
        },
    }
    manifest = _write_cache(cache_dir, z, manifest)
    log(f"latent cache: wrote {len(manifest['shards'])} shard(s) to {cache_dir}")
    return LatentCache(cache_dir, manifest, rebuilt=True)
