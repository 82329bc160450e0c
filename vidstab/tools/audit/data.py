"""1. Data: non-finite, empty, extreme, constant and frozen samples, robust outliers, value percentiles."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .findings import _name_ids, finding

# Normalised latents (VAE output times its scaling factor) live in roughly [-5, 5]; a value beyond 20 comes
# from a broken encode or a missing scaling factor and turns an fp16 loss into inf within a few layers.
DEFAULT_ABSMAX_THRESHOLD = 20.0

# Per-sample std below this is a constant (blank or frozen) clip.
DEFAULT_CONSTANT_STD = 1e-6

# |robust z| above this marks a sample whose absmax or std is unlike the rest of the data set.
DEFAULT_OUTLIER_Z = 6.0

# Values kept per sample for the data set's percentiles: bounded memory on any data set size.
_VALUES_PER_SAMPLE = 4096

_MAX_PERCENTILE_VALUES = 2_000_000


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
