#!/usr/bin/env python
"""Claim: the reference trainer's data path keeps memory flat as the data set grows.

For each data-set size this measures, in a fresh process each, the peak growth of anonymous resident memory
(``RssAnon`` in /proc/self/status: what the process cannot give back; file pages of memory-mapped shards are
reclaimable and not counted) while reading every item once, batch by batch, as the trainer does:

* ``latents_lazy``  ``LatentCache`` (one safetensors ``safe_open`` slice per item, what training reads)
  vs ``latents_eager``: every shard concatenated in memory (``load_file`` + ``torch.cat``: the old cache);
* ``videos_lazy``   ``moving_shapes_dataset`` rendering each clip when read (what encoding reads)
  vs ``videos_eager``: every clip stacked into one array (the old in-memory data set).

    python benchmarks/bench_data_scale.py                  # sizes 1000, 2000, 4000 clips
    python benchmarks/bench_data_scale.py --sizes 500 1000

The last line of output is one JSON object: per mode and size, the peak growth in MiB and the data size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

#: One latent clip of the benchmark: (C, T', H', W') float32 = 80 KiB, a 17x128x128 clip through Wan's VAE.
LATENT_SHAPE = (16, 5, 16, 16)
VIDEO = (9, 32, 32)  # frames, height, width of the moving-shapes clips
BATCH = 32
MODES = ("latents_lazy", "latents_eager", "videos_lazy", "videos_eager")


def rss_anon_mib() -> float:
    """Anonymous resident memory of this process (Linux), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def write_latent_cache(folder: Path, num_samples: int, per_shard: int = 512) -> int:
    """A cache folder of ``num_samples`` random latents in shards (manifest as ``encode_to_cache`` writes it). Returns bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards, total = [], 0
    generator = torch.Generator().manual_seed(0)
    for index, start in enumerate(range(0, num_samples, per_shard)):
        count = min(per_shard, num_samples - start)
        name = f"latents-{index:05d}.safetensors"
        save_file({"latents": torch.randn((count, *LATENT_SHAPE), generator=generator)}, str(folder / name))
        size = (folder / name).stat().st_size
        shards.append({"file": name, "num_samples": count, "bytes": size, "sha256": ""})
        total += size
    manifest = {"schema": 1, "fingerprint": "bench", "sample_ids": [f"s{i:07d}" for i in range(num_samples)],
                "latent_shape": list(LATENT_SHAPE), "shards": shards, "normalization": {"mean": [0.0] * 16, "std": [1.0] * 16}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return total


def measure(mode: str, num_samples: int, folder: Path) -> dict:
    """Peak RssAnon growth (MiB) while reading every item of ``mode``'s data once, batch by batch."""
    import torch

    from vidstab.reference.data import collate_videos, moving_shapes_dataset
    from vidstab.reference.vae import LatentCache, collate_latents

    base = peak = rss_anon_mib()
    checksum = 0.0
    if mode.startswith("latents"):
        cache = LatentCache.load(folder, verify=False)
        if mode == "latents_eager":
            everything = cache.latents  # every shard in memory at once
            peak = max(peak, rss_anon_mib())
            for start in range(0, len(cache), BATCH):
                checksum += float(everything[start:start + BATCH].sum())
        else:
            loader = torch.utils.data.DataLoader(cache, batch_size=BATCH, collate_fn=collate_latents)
            for batch in loader:
                checksum += float(batch["latents"].sum())
                peak = max(peak, rss_anon_mib())
        data_mib = len(cache) * torch.Size(LATENT_SHAPE).numel() * 4 / 2**20
    else:
        frames, height, width = VIDEO
        ds = moving_shapes_dataset(num_samples, frames, (height, width), seed=0)
        if mode == "videos_eager":
            everything = ds[:]["video"]
            peak = max(peak, rss_anon_mib())
            checksum = float(everything.sum())
        else:
            for start in range(0, len(ds), BATCH):
                batch = collate_videos([ds[i] for i in range(start, min(start + BATCH, len(ds)))])
                checksum += float(batch["video"].sum())
                peak = max(peak, rss_anon_mib())
        data_mib = num_samples * frames * 3 * height * width * 4 / 2**20
    return {"mode": mode, "num_samples": num_samples, "data_mib": round(data_mib, 1), "peak_growth_mib": round(peak - base, 1),
            "checksum_finite": checksum == checksum}


def run_measure(mode: str, num_samples: int, folder: Path) -> dict:
    """:func:`measure` in a fresh Python process (peaks of one mode never hide another's)."""
    proc = subprocess.run([sys.executable, __file__, "--measure", mode, "--num_samples", str(num_samples), "--folder", str(folder)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} at {num_samples}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000], help="Data-set sizes in clips.")
    ap.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--num_samples", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.num_samples, args.folder)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            folder = Path(tmp) / f"cache-{n}"
            write_latent_cache(folder, n)
            rows += [run_measure(mode, n, folder) for mode in MODES]
    print(f"{'clips':>7} {'data MiB (latents / videos)':>28} | peak RssAnon growth MiB: {'latents lazy':>12} {'eager':>7} | {'videos lazy':>11} {'eager':>7}")
    for n in args.sizes:
        r = {row["mode"]: row for row in rows if row["num_samples"] == n}
        print(f"{n:>7} {r['latents_lazy']['data_mib']:>13} / {r['videos_lazy']['data_mib']:<12} | {'':>24}"
              f"{r['latents_lazy']['peak_growth_mib']:>12} {r['latents_eager']['peak_growth_mib']:>7} | "
              f"{r['videos_lazy']['peak_growth_mib']:>11} {r['videos_eager']['peak_growth_mib']:>7}")
    print(json.dumps({"benchmark": "data_scale", "batch": BATCH, "latent_shape": list(LATENT_SHAPE), "video": list(VIDEO), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
