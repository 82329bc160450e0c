"""Preflight audit: find what will make a run unstable before it costs a GPU-week.

The checklist (data, VAE latents, custom losses, attention, LR warm-up) as small functions, each returning a
list of *findings*: plain dicts ``{"check", "severity", "message", "details"}`` with ``severity`` one of

- ``"info"``: a measurement worth reading (latent range percentiles, how many attention calls use SDPA);
- ``"warn"``: probably a problem, training may still work (no warm-up, manual softmax attention);
- ``"block"``: training will fail or is pointless (NaN in the data, fp16 without loss scaling).

:func:`run_audit` runs the checks it is given inputs for and returns an :class:`AuditReport`;
:func:`audit_before_training` is the entry point for a trainer's ``--audit`` flag. ``vidstab audit`` (see
:mod:`vidstab.cli`) is the command-line face of the same functions.

Everything here reads files (safetensors, JSON, YAML) and never unpickles anything.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import math
import re
import textwrap
import tokenize
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SEVERITIES = ("info", "warn", "block")

# Normalised latents (VAE output times its scaling factor) live in roughly [-5, 5]; a value beyond 20 comes
# from a broken encode or a missing scaling factor and turns an fp16 loss into inf within a few layers.
DEFAULT_ABSMAX_THRESHOLD = 20.0
# Per-sample std below this is a constant (blank or frozen) clip.
DEFAULT_CONSTANT_STD = 1e-6
# |robust z| above this marks a sample whose absmax or std is unlike the rest of the data set.
DEFAULT_OUTLIER_Z = 6.0
# Activation magnitudes that leave too little headroom: fp16's largest finite value is 65504.
ACTIVATION_LIMIT_FP32 = 1e4
ACTIVATION_LIMIT_FP16 = 3e4
# Prediction types the reference objective (and diffusers' schedulers) understand.
KNOWN_PREDICTION_TYPES = ("epsilon", "v_prediction", "flow_matching", "sample")
# AdamW on a transformer above this LR diverges more often than not.
HIGH_ADAMW_LR = 1e-3
# Values kept per sample for the data set's percentiles: bounded memory on any data set size.
_VALUES_PER_SAMPLE = 4096
_MAX_PERCENTILE_VALUES = 2_000_000
# How many ids a finding's message names before it says "and N more".
_IDS_IN_MESSAGE = 8


# ----------------------------------------------------------------------------------------------------
# Findings and the report


def finding(check: str, severity: str, message: str, **details: Any) -> dict:
    """One finding: ``{"check", "severity", "message", "details"}`` (details must be JSON-serialisable)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    return {"check": check, "severity": severity, "message": message, "details": details}


def _name_ids(ids: list[str]) -> str:
    """``a, b, c`` or ``a, b, ... (+12 more)``: ids short enough for a one-line message."""
    shown = ", ".join(ids[:_IDS_IN_MESSAGE])
    return shown + (f" (+{len(ids) - _IDS_IN_MESSAGE} more)" if len(ids) > _IDS_IN_MESSAGE else "")


@dataclass
class AuditReport:
    """The findings of one audit, with the blocking ones singled out."""

    findings: list[dict] = field(default_factory=list)
    """Every finding, in the order the checks ran."""

    @property
    def blocking(self) -> list[dict]:
        """Findings with severity ``"block"``: training should not start while any exist."""
        return [f for f in self.findings if f["severity"] == "block"]

    @property
    def warnings(self) -> list[dict]:
        """Findings with severity ``"warn"``."""
        return [f for f in self.findings if f["severity"] == "warn"]

    @property
    def ok(self) -> bool:
        """True when nothing blocks."""
        return not self.blocking

    def extend(self, findings: Iterable[dict]) -> None:
        """Add findings (from one of the ``audit_*`` functions)."""
        self.findings.extend(findings)

    def to_dict(self) -> dict:
        """``{"schema", "ok", "counts": {severity: n}, "findings": [...]}``."""
        counts = {s: sum(f["severity"] == s for f in self.findings) for s in SEVERITIES}
        return {"schema": 1, "ok": self.ok, "counts": counts, "findings": self.findings}

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        """The report as JSON; also written to ``path`` when given."""
        text = json.dumps(_strict(self.to_dict()), indent=indent, default=_json_default, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def format_table(self, width: int = 100) -> str:
        """A plain-text table, worst first, for a terminal: severity, check, message (wrapped)."""
        order = {"block": 0, "warn": 1, "info": 2}
        rows = sorted(self.findings, key=lambda f: order[f["severity"]])
        check_w = max([len("check")] + [len(f["check"]) for f in rows])
        msg_w = max(30, width - 8 - check_w - 4)
        lines = [f"{'SEVERITY':<8}  {'check':<{check_w}}  message", "-" * min(width, 8 + 2 + check_w + 2 + msg_w)]
        for f in rows:
            wrapped = textwrap.wrap(f["message"], msg_w) or [""]
            lines.append(f"{f['severity'].upper():<8}  {f['check']:<{check_w}}  {wrapped[0]}")
            lines.extend(f"{'':<8}  {'':<{check_w}}  {more}" for more in wrapped[1:])
        counts = self.to_dict()["counts"]
        verdict = "BLOCKED: fix the blocking findings before training" if self.blocking else "OK to train"
        lines.append("")
        lines.append(f"{counts['block']} blocking, {counts['warn']} warnings, {counts['info']} info -> {verdict}")
        return "\n".join(lines)


def _json_default(obj: Any) -> Any:
    """JSON fallback for tensors, numpy scalars, paths and non-finite floats in details."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return repr(obj)


def _strict(obj: Any) -> Any:
    """Details as strict JSON: non-finite floats become the strings "nan"/"inf"/"-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, Mapping):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------------
# 1. Data: videos or latents


def audit_tensors(
    samples: Iterable[tuple[str, torch.Tensor]],
    *,
    name: str = "data",
    absmax_threshold: float = DEFAULT_ABSMAX_THRESHOLD,
    constant_std: float = DEFAULT_CONSTANT_STD,
    outlier_z: float = DEFAULT_OUTLIER_Z,
    frame_dim: int | None = None,
    max_listed: int = 50,
) -> list[dict]:
    """Scan ``(sample_id, tensor)`` pairs one at a time: non-finite values, constant or frozen clips,
    extreme values, per-sample statistics, value percentiles and robust outliers.

    Args:
        samples: any iterable (a data set, :func:`iter_latent_cache`); read once, one sample in memory.
        name: prefix of the ``check`` names (``"latents"`` gives ``latents.nonfinite`` ...).
        absmax_threshold: a sample whose largest finite |value| exceeds this blocks (20 suits normalised
            latents; raw video in [-1, 1] never gets near it).
        constant_std: a sample whose std is below this is a constant clip (blank frames).
        outlier_z: |robust z-score| of per-sample absmax or std (median/MAD over the data set) above which
            a sample is reported as an outlier.
        frame_dim: the frame axis of one sample, to find clips whose frames are all identical (a frozen
            video). ``None``: axis 1 for 4-D latents ``[C, F, H, W]``; skipped for other ranks.
        max_listed: per-sample statistics are listed in ``details`` for up to this many samples (the most
            extreme ones first on large data sets).

    Severity: non-finite values, empty samples and extreme values block; constant and frozen clips and
    outliers warn; the statistics are info.
    """
    nonfinite: list[str] = []
    empty: list[str] = []
    extreme: list[tuple[str, float]] = []
    constant: list[str] = []
    frozen: list[str] = []
    stats: list[dict] = []
    kept_values: list[torch.Tensor] = []
    kept = 0
    generator = torch.Generator().manual_seed(0)  # fixed: the same data gives the same percentiles

    for sample_id, tensor in samples:
        sample_id = str(sample_id)
        t = torch.as_tensor(tensor).detach().to("cpu", torch.float32)
        if t.numel() == 0:
            empty.append(sample_id)
            continue
        finite_mask = torch.isfinite(t)
        n_bad = int((~finite_mask).sum())
        values = t[finite_mask] if n_bad else t.reshape(-1)
        if n_bad:
            nonfinite.append(sample_id)
        if values.numel() == 0:
            stats.append({"id": sample_id, "absmax": None, "mean": None, "std": None, "nonfinite": n_bad})
            continue
        absmax = float(values.abs().max())
        std = float(values.std(unbiased=False))
        stats.append(
            {"id": sample_id, "absmax": absmax, "mean": float(values.mean()), "std": std, "nonfinite": n_bad}
        )
        if absmax > absmax_threshold:
            extreme.append((sample_id, absmax))
        if std < constant_std:
            constant.append(sample_id)
        else:
            dim = frame_dim if frame_dim is not None else (1 if t.ndim == 4 else None)
            if dim is not None and t.ndim > dim and t.shape[dim] > 1 and not n_bad:
                # Every frame equal to the first: a still image posing as a video (or a decode that repeated
                # one frame); the temporal layers learn nothing from it.
                first = t.narrow(dim, 0, 1)
                if bool(((t - first).abs() <= constant_std).all()):
                    frozen.append(sample_id)
        if kept < _MAX_PERCENTILE_VALUES:
            take = min(_VALUES_PER_SAMPLE, values.numel(), _MAX_PERCENTILE_VALUES - kept)
            idx = torch.randint(values.numel(), (take,), generator=generator)
            kept_values.append(values[idx])
            kept += take

    findings: list[dict] = []
    n = len(stats) + len(empty)
    if n == 0:
        return [finding(f"{name}.empty", "block", f"{name}: no samples to audit (the source is empty)")]

    if nonfinite:
        findings.append(finding(
            f"{name}.nonfinite", "block",
            f"{len(nonfinite)} of {n} samples contain NaN/Inf: {_name_ids(nonfinite)}. One such sample makes the "
            "loss NaN; fix or drop them (the data set or the latent cache).",
            sample_ids=nonfinite,
        ))
    if empty:
        findings.append(finding(
            f"{name}.empty_sample", "block",
            f"{len(empty)} samples have no values: {_name_ids(empty)}.", sample_ids=empty,
        ))
    if extreme:
        ids = [i for i, _ in extreme]
        worst = max(v for _, v in extreme)
        findings.append(finding(
            f"{name}.extreme", "block",
            f"{len(extreme)} samples have |value| > {absmax_threshold:g} (largest {worst:.3g}): {_name_ids(ids)}. "
            "Normalised latents stay within a few units; check the VAE scaling factor and these clips.",
            sample_ids=ids, absmax={i: v for i, v in extreme[:max_listed]}, threshold=absmax_threshold,
        ))
    if constant:
        findings.append(finding(
            f"{name}.constant", "warn",
            f"{len(constant)} samples are constant (std < {constant_std:g}), e.g. blank clips: {_name_ids(constant)}.",
            sample_ids=constant,
        ))
    if frozen:
        findings.append(finding(
            f"{name}.frozen", "warn",
            f"{len(frozen)} clips have all frames identical (a still image or a repeated decode): {_name_ids(frozen)}.",
            sample_ids=frozen,
        ))

    finite_stats = [s for s in stats if s["absmax"] is not None]
    outliers = _robust_outliers(finite_stats, outlier_z) if len(finite_stats) >= 8 else {}
    # Samples already blocked or warned about are not repeated as outliers.
    named = set(nonfinite) | {i for i, _ in extreme} | set(constant)
    outliers = {k: v for k, v in outliers.items() if k not in named}
    if outliers:
        ids = list(outliers)
        findings.append(finding(
            f"{name}.outliers", "warn",
            f"{len(ids)} samples have an absmax or std far from the rest (|robust z| > {outlier_z:g}): {_name_ids(ids)}.",
            sample_ids=ids, robust_z=outliers,
        ))

    percentiles: dict[str, float] = {}
    if kept_values:
        pool = torch.cat(kept_values).double()
        qs = torch.tensor([0.001, 0.5, 0.999], dtype=torch.float64)
        p = torch.quantile(pool, qs).tolist()
        percentiles = {"p0.1": p[0], "p50": p[1], "p99.9": p[2], "min": float(pool.min()), "max": float(pool.max())}
    listed = finite_stats
    if len(listed) > max_listed:  # large data sets: keep the most extreme samples only
        listed = sorted(listed, key=lambda s: -s["absmax"])[:max_listed]
    range_text = (
        f"values p0.1={percentiles['p0.1']:.3g}, p50={percentiles['p50']:.3g}, p99.9={percentiles['p99.9']:.3g}"
        if percentiles else "no finite values"
    )
    findings.append(finding(
        f"{name}.stats", "info",
        f"{n} samples scanned; {range_text} (percentiles from up to {_VALUES_PER_SAMPLE} values per sample).",
        num_samples=n, percentiles=percentiles, per_sample=listed,
    ))
    return findings


def _robust_outliers(stats: list[dict], z_limit: float) -> dict[str, float]:
    """``{sample_id: z}`` for samples whose absmax or std has |robust z| > z_limit.

    Robust z = 0.6745 * (x - median) / MAD: one wild sample cannot hide itself by inflating the spread
    the way it would with mean and standard deviation.
    """
    out: dict[str, float] = {}
    for key in ("absmax", "std"):
        x = torch.tensor([s[key] for s in stats], dtype=torch.float64)
        med = x.median()
        mad = (x - med).abs().median()
        if mad <= 0:
            # More than half the samples share one value: fall back to the mean absolute deviation.
            mad = (x - med).abs().mean() / 1.2533
        if mad <= 0:
            continue
        z = 0.6745 * (x - med) / mad
        for s, zi in zip(stats, z.tolist()):
            if abs(zi) > z_limit and abs(zi) > abs(out.get(s["id"], 0.0)):
                out[s["id"]] = round(zi, 2)
    return out


def iter_latent_cache(cache_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(sample_id, latent)`` from a latent cache folder, one shard in memory at a time.

    Understands two layouts:

    - ``manifest.json`` (written by ``vidstab.reference.vae.encode_to_cache``) naming its shards, under
      ``"shards"`` as file names or ``{"file"|"path": ..., "sample_ids": [...]}`` entries, optionally with a
      top-level ``"sample_ids"`` list in shard order;
    - any folder of ``*.safetensors`` files with a ``latents`` tensor ``[N, ...]``, the ids in a sibling
      ``<shard>.json`` (``{"sample_ids": [...]}`` or a plain list), in the file's safetensors metadata
      (``sample_ids`` as a JSON string), or else ``<shard>:<index>``.
    """
    from safetensors import safe_open  # local import: only the cache reader needs it

    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise FileNotFoundError(f"latent cache {str(cache_dir)!r} is not a folder")
    shards: list[tuple[Path, list[str] | None]] = []
    manifest_ids: list[str] | None = None
    manifest_path = cache_dir / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        for entry in manifest.get("shards", []) if isinstance(manifest, dict) else []:
            if isinstance(entry, str):
                shards.append((cache_dir / entry, None))
            elif isinstance(entry, Mapping):
                file = entry.get("file") or entry.get("path") or entry.get("name")
                if file:
                    ids = entry.get("sample_ids")
                    shards.append((cache_dir / str(file), list(map(str, ids)) if ids is not None else None))
        if isinstance(manifest, dict) and isinstance(manifest.get("sample_ids"), list):
            manifest_ids = [str(i) for i in manifest["sample_ids"]]
    if not shards:
        shards = [(p, None) for p in sorted(cache_dir.glob("*.safetensors"))]
    if not shards:
        raise FileNotFoundError(f"no *.safetensors shards in latent cache {str(cache_dir)!r}")

    offset = 0
    for path, ids in shards:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            key = "latents" if "latents" in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise KeyError(f"{path.name}: no 'latents' tensor (keys: {keys})")
            latents = f.get_tensor(key)
            metadata = f.metadata() or {}
        if ids is None:
            ids = _shard_ids(path, metadata)
        if ids is None and manifest_ids is not None:
            ids = manifest_ids[offset : offset + latents.shape[0]]
        if ids is None or len(ids) != latents.shape[0]:
            ids = [f"{path.stem}:{i}" for i in range(latents.shape[0])]
        offset += latents.shape[0]
        for sample_id, latent in zip(ids, latents):
            yield sample_id, latent


def _shard_ids(path: Path, metadata: dict) -> list[str] | None:
    """Sample ids for one shard from its sibling JSON or its safetensors metadata, if either has them."""
    sibling = path.with_suffix(".json")
    if sibling.is_file():
        data = json.loads(sibling.read_text(encoding="utf-8"))
        ids = data.get("sample_ids") if isinstance(data, dict) else data
        if isinstance(ids, list):
            return [str(i) for i in ids]
    if "sample_ids" in metadata:
        try:
            return [str(i) for i in json.loads(metadata["sample_ids"])]
        except ValueError:
            return None
    return None


def audit_latent_cache(cache_dir: str | Path, **kwargs: Any) -> list[dict]:
    """:func:`audit_tensors` over a latent cache folder (see :func:`iter_latent_cache`); ``check`` names
    start with ``latents.``. An unreadable cache is a blocking finding rather than an exception."""
    try:
        return audit_tensors(iter_latent_cache(cache_dir), name="latents", **kwargs)
    except (OSError, KeyError, ValueError) as err:
        return [finding("latents.read", "block", f"cannot read latent cache {str(cache_dir)!r}: {err}")]


def audit_video_folder(data_dir: str | Path, num_frames: int = 16, resolution: int = 64, **kwargs: Any) -> list[dict]:
    """Decode every video under ``data_dir`` (with the reference data loader) and audit the clips.

    Files that cannot be decoded are blocking findings (``data.decode``) naming each file; the clips
    ``[T, 3, H, W]`` in ``[-1, 1]`` are scanned by :func:`audit_tensors` with frames on axis 0.
    """
    # Imported here: the core package never imports vidstab.reference at module level.
    from vidstab.reference.data import video_folder_dataset

    try:
        ds, skipped = video_folder_dataset(data_dir, num_frames, resolution, skip_bad_samples=True)
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


# ----------------------------------------------------------------------------------------------------
# 2. Model: attention implementation and activation magnitudes (one dry-run forward)


def _is_attention(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


class _DryRunProbe:
    """Hooks and patches for one dry-run forward.

    A module stack kept by forward pre/post hooks tells, at any moment, which module is running; softmax and
    ``scaled_dot_product_attention`` are wrapped to count calls against the innermost attention-like module
    on the stack (or the innermost module). Forward hooks record each module's largest |activation| and
    whether its output has non-finite values, in execution order.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # "blocks.0.attn (Attention)": the qualified name a user can find, and the class for context.
        self.names = {m: f"{n or '<root>'} ({type(m).__name__})" for n, m in model.named_modules()}
        self.stack: list[torch.nn.Module] = []
        self.softmax_calls: dict[str, int] = {}
        self.sdpa_calls: dict[str, int] = {}
        self.absmax: dict[str, float] = {}
        self.nonfinite_order: list[str] = []
        self._inside = False
        self._handles: list = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _owner(self) -> str:
        for module in reversed(self.stack):
            if _is_attention(module):
                return self.names[module]
        return self.names[self.stack[-1]] if self.stack else "<outside the model>"

    def _counting(self, original: Callable, table: dict[str, int]) -> Callable:
        def wrapper(*args, **kwargs):
            if self._inside:  # F.softmax calls Tensor.softmax: count the outermost call only
                return original(*args, **kwargs)
            owner = self._owner()
            table[owner] = table.get(owner, 0) + 1
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return wrapper

    def _record(self, module: torch.nn.Module, output: Any) -> None:
        name = self.names[module]
        for t in _tensors(output):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            t = t.detach()
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                if name not in self.nonfinite_order:
                    self.nonfinite_order.append(name)
                t = t[finite]
                if t.numel() == 0:
                    continue
            self.absmax[name] = max(self.absmax.get(name, 0.0), float(t.abs().max()))

    def __enter__(self) -> "_DryRunProbe":
        import torch.nn.functional as F

        for obj, attr, table in (
            (torch, "softmax", self.softmax_calls),
            (F, "softmax", self.softmax_calls),
            (torch.Tensor, "softmax", self.softmax_calls),
            (F, "scaled_dot_product_attention", self.sdpa_calls),
        ):
            original = getattr(obj, attr)
            self._saved.append((obj, attr, original))
            setattr(obj, attr, self._counting(original, table))

        def pre(module, args):
            self.stack.append(module)

        def post(module, args, output):
            if self.stack and self.stack[-1] is module:
                self.stack.pop()
            self._record(module, output)

        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for obj, attr, original in reversed(self._saved):
            setattr(obj, attr, original)
        self.stack.clear()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module output (tensor, tuple/list, dict, dataclass-like ``BaseOutput``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors(item)


def guess_example_inputs(model: torch.nn.Module) -> tuple | None:
    """Tiny inputs for a diffusers-style video model (``config.in_channels`` and optionally ``patch_size``):
    ``(latents [1, C, 2pt, 2ph, 2pw], timestep [1])``; ``None`` when the model does not say enough."""
    config = getattr(model, "config", None)
    channels = getattr(config, "in_channels", None) if config is not None else None
    if not isinstance(channels, int):
        return None
    patch = getattr(config, "patch_size", None) or (1, 2, 2)
    if isinstance(patch, int):
        patch = (1, patch, patch)
    try:
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
    except StopIteration:
        device, dtype = torch.device("cpu"), torch.float32
    shape = (1, channels, *(2 * int(p) for p in patch))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(shape, generator=generator).to(device, dtype)
    return latents, torch.full((1,), 500, device=device)


def audit_model(
    model: torch.nn.Module,
    example_inputs: tuple | Mapping | None = None,
    *,
    dry_run_fn: Callable[[], Any] | None = None,
    precision: str = "no",
    activation_limit: float | None = None,
) -> list[dict]:
    """One no-grad dry-run forward that finds manual-softmax attention and dangerous activation magnitudes.

    Args:
        model: the model to inspect (left as it was: hooks and patches are removed afterwards).
        example_inputs: positional args (tuple) or keyword args (mapping) for ``model(...)``; guessed for
            diffusers-style video models when neither this nor ``dry_run_fn`` is given.
        dry_run_fn: a callable running a forward of ``model`` itself (e.g. the trainer's loss on one
            micro-batch); takes precedence over ``example_inputs``.
        precision: ``"no"``, ``"bf16"`` or ``"fp16"`` (fp16 lowers the activation limit).
        activation_limit: largest acceptable |activation|; default 1e4, or 3e4 under fp16 (max 65504).

    Findings: ``model.attention`` (warn) for each attention-like module that calls softmax without
    ``F.scaled_dot_product_attention``; ``model.sdpa`` (info) summarising SDPA use; ``model.activations``
    (warn) for modules above the limit; ``model.nonfinite`` (block) naming the first module whose output
    is NaN/Inf; ``model.dry_run`` (warn) when the forward could not run (then only a source scan is done).
    """
    if activation_limit is None:
        activation_limit = ACTIVATION_LIMIT_FP16 if precision == "fp16" else ACTIVATION_LIMIT_FP32
    findings: list[dict] = []
    guessed = False
    if dry_run_fn is None and example_inputs is None:
        example_inputs = guess_example_inputs(model)
        guessed = example_inputs is not None
    if dry_run_fn is None and example_inputs is None:
        findings.append(finding(
            "model.dry_run", "warn",
            f"no dry run: give example inputs for {type(model).__name__} to check attention and activations; "
            "only the attention source scan ran",
        ))
        return findings + _static_attention_scan(model)

    probe = _DryRunProbe(model)
    try:
        with torch.no_grad(), probe:
            if dry_run_fn is not None:
                dry_run_fn()
            elif isinstance(example_inputs, Mapping):
                model(**example_inputs)
            else:
                model(*example_inputs)
    except Exception as err:  # noqa: BLE001 -- any failure of the user's forward becomes a finding
        how = "guessed inputs" if guessed else "the given inputs"
        findings.append(finding(
            "model.dry_run", "warn", f"dry-run forward with {how} failed: {type(err).__name__}: {err}; "
            "only the attention source scan ran",
        ))
        return findings + _static_attention_scan(model)

    for owner, n in sorted(probe.softmax_calls.items()):
        if probe.sdpa_calls.get(owner):
            continue
        findings.append(finding(
            "model.attention", "warn",
            f"{owner} computes softmax itself ({n} calls) instead of torch.nn.functional.scaled_dot_product_attention; "
            "SDPA is fused and numerically safer on long video token sequences (and saves memory)"
            + ("; nn.MultiheadAttention uses SDPA when called with need_weights=False" if "MultiheadAttention" in owner else ""),
            module=owner, softmax_calls=n,
        ))
    n_sdpa = sum(probe.sdpa_calls.values())
    attn_modules = [probe.names[m] for m in model.modules() if _is_attention(m)]
    findings.append(finding(
        "model.sdpa", "info",
        f"{n_sdpa} scaled_dot_product_attention calls in {len(probe.sdpa_calls)} modules; "
        f"{len(attn_modules)} attention-like modules",
        sdpa_calls=probe.sdpa_calls, softmax_calls=probe.softmax_calls,
    ))
    if probe.nonfinite_order:
        first = probe.nonfinite_order[0]
        findings.append(finding(
            "model.nonfinite", "block",
            f"the dry-run forward produces NaN/Inf; first in {first} (then {len(probe.nonfinite_order) - 1} more modules)",
            modules=probe.nonfinite_order,
        ))
    hot = {n: v for n, v in probe.absmax.items() if v > activation_limit}
    if hot:
        worst = max(hot, key=hot.get)
        findings.append(finding(
            "model.activations", "warn",
            f"{len(hot)} modules have activations above {activation_limit:g} (largest {hot[worst]:.3g} in {worst}); "
            f"fp16 overflows at 65504",
            modules=hot, limit=activation_limit, precision=precision,
        ))
    top = sorted(probe.absmax.items(), key=lambda kv: -kv[1])[:10]
    findings.append(finding(
        "model.activation_stats", "info",
        "largest activations: " + ", ".join(f"{n}={v:.3g}" for n, v in top[:5]),
        top=dict(top), guessed_inputs=guessed,
    ))
    return findings


def _static_attention_scan(model: torch.nn.Module) -> list[dict]:
    """Without a forward: attention-like module classes whose forward source calls softmax but not SDPA."""
    findings, seen = [], set()
    for name, module in model.named_modules():
        cls = type(module)
        if not _is_attention(module) or cls in seen:
            continue
        seen.add(cls)
        try:
            src = _code_only(inspect.getsource(cls.forward))
        except (OSError, TypeError):
            continue
        if "softmax" in src and "scaled_dot_product_attention" not in src:
            findings.append(finding(
                "model.attention", "warn",
                f"{cls.__name__} (e.g. {name or '<root>'}) calls softmax in its forward and not "
                "scaled_dot_product_attention (source scan; heuristic)",
                module=name, cls=cls.__name__,
            ))
    return findings


# ----------------------------------------------------------------------------------------------------
# 3. Training configuration


def _flatten(cfg: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{leaf_key: value}`` (the innermost key wins; sections like ``optimizer:`` vanish)."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out.setdefault(str(key), value)
    return out


def _first(flat: Mapping[str, Any], *keys: str) -> tuple[str | None, Any]:
    for key in keys:
        if key in flat:
            return key, flat[key]
    return None, None


def audit_training_config(cfg: Mapping[str, Any]) -> list[dict]:
    """Check a training configuration (a dict, nested sections allowed) against the preflight checklist.

    Keys read (first one present wins): ``lr_warmup_steps | warmup_steps``; ``mixed_precision | precision``;
    ``weight_dtype | dtype``; loss scaling ``grad_scaler | use_grad_scaler | loss_scaling`` (bool) or
    ``loss_scale`` (number/"dynamic"); ``learning_rate | lr``; ``optimizer``; ``max_grad_norm | grad_clip``;
    ``prediction_type``.

    - no LR warm-up (0 or missing) -> warn: the first thousands of steps have the noisiest gradients;
    - fp16 without loss scaling -> block: small gradients underflow to 0 and large ones overflow.
      ``mixed_precision: fp16`` under Accelerate gets a GradScaler automatically, so it blocks only when
      scaling is switched off explicitly, or when the weights themselves are fp16 with no scaler named;
    - AdamW with an LR above 1e-3 -> warn;
    - ``max_grad_norm`` missing or 0 -> warn (no clipping);
    - unknown ``prediction_type`` -> block (the target would be wrong); missing -> info.
    """
    flat = _flatten(cfg)
    findings: list[dict] = []

    key, warmup = _first(flat, "lr_warmup_steps", "warmup_steps", "num_warmup_steps")
    if not warmup:
        findings.append(finding(
            "config.warmup", "warn",
            "no LR warm-up (" + (f"{key} = {warmup}" if key else "lr_warmup_steps not set") + "): the first few "
            "thousand steps have the noisiest gradients; warm up linearly (e.g. lr_warmup_steps: 1000)",
            key=key, value=warmup,
        ))

    _, precision = _first(flat, "mixed_precision", "precision")
    _, weight_dtype = _first(flat, "weight_dtype", "dtype", "param_dtype")
    scaler_key, scaler = _first(flat, "grad_scaler", "use_grad_scaler", "loss_scaling", "loss_scale")
    fp16_mixed = str(precision).lower() in ("fp16", "float16", "half")
    fp16_weights = str(weight_dtype).lower() in ("fp16", "float16", "half", "torch.float16")
    scaling_off = scaler_key is not None and (scaler in (False, None, 0, "none", "off", "false", "no"))
    if (fp16_mixed or fp16_weights) and (scaling_off or (fp16_weights and scaler_key is None and not fp16_mixed)):
        findings.append(finding(
            "config.fp16_scaling", "block",
            "fp16 without loss scaling: gradients below 6e-8 flush to zero and overflows go unnoticed; "
            "use mixed_precision: fp16 with Accelerate's GradScaler (the default) or bf16",
            mixed_precision=precision, weight_dtype=weight_dtype, scaler=scaler,
        ))
    elif fp16_mixed:
        findings.append(finding(
            "config.fp16_scaling", "info",
            "fp16 mixed precision with dynamic loss scaling (Accelerate's GradScaler); overflow steps are skipped "
            "by the scaler and recorded by vidstab",
        ))

    _, lr = _first(flat, "learning_rate", "lr")
    _, optimizer = _first(flat, "optimizer", "optimizer_type", "optim")
    is_adamw = optimizer is None or "adam" in str(optimizer).lower()
    try:
        lr_value = float(lr) if lr is not None else None
    except (TypeError, ValueError):
        lr_value = None
    if lr_value is not None and is_adamw and lr_value > HIGH_ADAMW_LR:
        findings.append(finding(
            "config.lr", "warn",
            f"learning rate {lr_value:g} is high for AdamW on a transformer (> {HIGH_ADAMW_LR:g}); "
            "diffusion transformers usually train at 1e-4 or below",
            lr=lr_value, optimizer=optimizer,
        ))

    key, clip = _first(flat, "max_grad_norm", "grad_clip", "clip_grad_norm")
    if not clip:
        findings.append(finding(
            "config.grad_clip", "warn",
            "no gradient clipping (" + (f"{key} = {clip}" if key else "max_grad_norm not set") + "); set "
            "max_grad_norm (e.g. 1.0): vidstab also reads the pre-clip norm it returns",
            key=key, value=clip,
        ))

    _, pred = _first(flat, "prediction_type")
    if pred is None:
        findings.append(finding("config.prediction_type", "info", "prediction_type not set (the trainer's default applies)"))
    elif pred not in KNOWN_PREDICTION_TYPES:
        findings.append(finding(
            "config.prediction_type", "block",
            f"unknown prediction_type {pred!r}; expected one of {', '.join(KNOWN_PREDICTION_TYPES)}",
            value=pred,
        ))
    checked = {"learning_rate": lr, "lr_warmup_steps": warmup, "mixed_precision": precision, "max_grad_norm": clip,
               "prediction_type": pred}
    findings.append(finding(
        "config.summary", "info", "checked: " + ", ".join(f"{k}={v}" for k, v in checked.items()), **checked,
    ))
    return findings


def load_config_file(path: str | Path) -> dict:
    """A YAML or JSON training config as a dict (``yaml.safe_load``: no arbitrary objects)."""
    import yaml

    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------------------------------
# 4. Loss source


# (pattern, what it does at the edge). Stable variants (log1p, log_softmax, logsumexp) do not match.
_RISKY_OPS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"(?<![\w.])(?:\w+\.)*log(?:2|10)?\s*\(|\.log(?:2|10)?_?\s*\("), "log(x) is -inf when x reaches zero (NaN below)"),
    (re.compile(r"\brsqrt\s*\(|\.rsqrt_?\s*\("), "rsqrt(x) is inf when x reaches zero"),
    (re.compile(r"(?<!r)\bsqrt\s*\(|\.sqrt_?\s*\("), "sqrt(x) has an infinite gradient when x reaches zero"),
    (re.compile(r"\breciprocal_?\s*\("), "1/x is inf when x reaches zero"),
    (re.compile(r"\bpow\s*\([^)]*,\s*-|\*\*\s*\(?\s*-"), "a negative power is inf when its base reaches zero"),
    # Division by anything but a number literal or a count (len, numel, shape, size).
    (re.compile(r"(?<![/*])/(?![/=])\s*(?!\s*[\d.]+(?:e-?\d+)?\b)(?!\s*(?:len\(|\w+\.numel\(|\w+\.shape|\w+\.size\(|math\.))"),
     "a division is inf when its divisor reaches zero"),
]
_EPSILON = re.compile(r"eps|epsilon|1e-\d|clamp|clip|nan_to_num|maximum|finfo|tiny", re.IGNORECASE)


def _code_only(source: str) -> str:
    """Source with comments and string literals blanked (same line numbers), so docstrings do not match."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError):
        return source
    lines = source.splitlines(keepends=True)
    blank = [list(line) for line in lines]
    for tok in tokens:
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = blank[r - 1]
                start = c0 if r == r0 else 0
                end = c1 if r == r1 else len(row)
                for c in range(start, min(end, len(row))):
                    if row[c] != "\n":
                        row[c] = " "
    out = ["".join(row) for row in blank]
    return "".join(out)


def audit_loss_source(fn_or_module: Any) -> list[dict]:
    """Scan a loss function's (or module's / class's) source for operations that reach inf at zero.

    ``log(``, ``/``, ``sqrt(``, ``rsqrt(``, ``reciprocal(`` and negative powers on a line with no epsilon,
    clamp or similar on the same line give a ``loss.source`` warning naming the
    line. A heuristic: it reads text, not values, so it can warn about a divisor that is never zero.
    """
    target = fn_or_module
    if isinstance(target, torch.nn.Module):
        target = type(target)
    label = getattr(target, "__qualname__", None) or repr(target)
    try:
        source = textwrap.dedent(inspect.getsource(target))
        _, first_line = inspect.getsourcelines(target)
        file = inspect.getsourcefile(target) or "?"
    except (OSError, TypeError):
        return [finding("loss.source", "info", f"source of {label} is not available; loss scan skipped")]
    code_lines = _code_only(source).splitlines()
    findings = []
    for i, line in enumerate(code_lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("def ", "class ", "@", "import ", "from ")):
            continue
        if _EPSILON.search(line):
            continue
        for pattern, why in _RISKY_OPS:
            if pattern.search(line):
                lineno = first_line + i
                findings.append(finding(
                    "loss.source", "warn",
                    f"{label} line {lineno}: `{stripped[:80]}`: {why}; add an epsilon (or clamp) "
                    "(heuristic source scan)",
                    file=file, line=lineno, code=stripped,
                ))
                break
    if not findings:
        findings.append(finding("loss.source", "info", f"{label}: no unguarded log/div/sqrt found (heuristic source scan)"))
    return findings


# ----------------------------------------------------------------------------------------------------
# Entry points


def load_object(spec: str) -> Any:
    """``"package.module:attribute"`` -> the attribute (imports the module)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError(f"expected 'module:attribute', got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run_audit(
    *,
    latents: str | Path | None = None,
    data_dir: str | Path | None = None,
    samples: Iterable[tuple[str, torch.Tensor]] | None = None,
    model: torch.nn.Module | None = None,
    example_inputs: tuple | Mapping | None = None,
    dry_run_fn: Callable[[], Any] | None = None,
    config: Mapping[str, Any] | str | Path | None = None,
    loss_fn: Any = None,
    precision: str | None = None,
    num_frames: int = 16,
    resolution: int = 64,
    absmax_threshold: float = DEFAULT_ABSMAX_THRESHOLD,
) -> AuditReport:
    """Run every check that has an input: a latent cache folder, a video folder, an iterable of
    ``(id, tensor)`` samples, a model (with ``example_inputs`` or ``dry_run_fn``), a training config (dict
    or YAML/JSON path) and a loss function. ``precision`` defaults to the config's ``mixed_precision``."""
    report = AuditReport()
    cfg: Mapping[str, Any] | None = None
    if config is not None:
        try:
            cfg = config if isinstance(config, Mapping) else load_config_file(config)
        except (OSError, ValueError) as err:
            report.extend([finding("config.read", "block", f"cannot read config {str(config)!r}: {err}")])
    if precision is None and cfg is not None:
        precision = str(_first(_flatten(cfg), "mixed_precision", "precision")[1] or "no")
    precision = precision or "no"

    if latents is not None:
        report.extend(audit_latent_cache(latents, absmax_threshold=absmax_threshold))
    if data_dir is not None:
        report.extend(audit_video_folder(data_dir, num_frames, resolution, absmax_threshold=absmax_threshold))
    if samples is not None:
        report.extend(audit_tensors(samples, absmax_threshold=absmax_threshold))
    if model is not None:
        report.extend(audit_model(model, example_inputs, dry_run_fn=dry_run_fn, precision=precision))
    if cfg is not None:
        report.extend(audit_training_config(cfg))
    if loss_fn is not None:
        report.extend(audit_loss_source(loss_fn))
    return report


def audit_before_training(
    model: torch.nn.Module,
    sample_latents: torch.Tensor,
    sample_ids: Iterable[str],
    training_config: Mapping[str, Any],
    dry_run_fn: Callable[[], Any] | None = None,
) -> AuditReport:
    """The trainer's ``--audit`` hook: audit some training latents ``[N, ...]`` (named by ``sample_ids``),
    the model (a forward via ``dry_run_fn``, e.g. the loss on one micro-batch; else guessed inputs) and the
    training config. The caller decides what to do with ``report.blocking`` (the reference trainer stops)."""
    ids = [str(i) for i in sample_ids]
    if len(ids) != sample_latents.shape[0]:
        raise ValueError(f"{len(ids)} sample ids for {sample_latents.shape[0]} latents")
    report = AuditReport()
    report.extend(audit_tensors(zip(ids, sample_latents), name="latents"))
    precision = str(_first(_flatten(training_config), "mixed_precision", "precision")[1] or "no")
    report.extend(audit_model(model, dry_run_fn=dry_run_fn, precision=precision))
    report.extend(audit_training_config(training_config))
    return report
