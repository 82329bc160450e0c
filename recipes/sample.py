#!/usr/bin/env python
"""Sample clips from a run folder exported by ``recipes/train.py`` (its ``transformer/``, ``vae/``, ``sampling.json``).

    python recipes/sample.py --model_dir output/vidstab-tiny                 # 4 clips -> output/vidstab-tiny/samples/
    python recipes/sample.py --model_dir output/vidstab-tiny --use_ema --num_videos 8 --sampler ddim

Writes ``clip_XX.mp4`` and ``strip.png`` (a row of frames per clip) and prints one JSON line: the files and,
when the run's latent cache is there, how far the sampled latents are from the nearest training clip next to
the same figure for Gaussian noise and for the data itself (``vidstab.reference.sampling``). Nothing named in
the folder is imported: the model class is VideoDiT, the VAE AutoencoderKLWan, the scheduler chosen here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_dir", required=True, help="The --output_dir of a finished training run.")
    p.add_argument("--use_ema", action="store_true", help="Sample the EMA weights (transformer_ema/).")
    p.add_argument("--num_videos", type=int, default=4)
    p.add_argument("--num_inference_steps", type=int, default=25)
    p.add_argument("--sampler", choices=["ddpm", "ddim"], default="ddpm", help="For epsilon / v-prediction (flow matching: Euler).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default=None, help="Default: MODEL_DIR/samples.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for name in ("num_videos", "num_inference_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from diffusers import AutoencoderKLWan

    from vidstab.reference.model import VideoDiT
    from vidstab.reference.sampling import make_scheduler, sample_clips
    from vidstab.reference.vae import LatentCache, LatentCacheError

    model_dir = Path(args.model_dir)
    transformer = model_dir / ("transformer_ema" if args.use_ema else "transformer")
    info_path = model_dir / "sampling.json"
    for needed in (transformer, info_path):
        if not needed.exists():
            hint = " (train with --use_ema)" if args.use_ema and needed == transformer else " (is this the --output_dir of a finished run?)"
            raise SystemExit(f"{needed}: missing{hint}")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    model = VideoDiT.from_pretrained(str(transformer)).to(args.device)
    vae_dir = model_dir / info["vae"] if info["vae"] == "vae" else Path(info["vae"])
    vae = AutoencoderKLWan.from_pretrained(str(vae_dir), local_files_only=True).to(args.device).eval()
    objective = info["objective"]
    scheduler = make_scheduler(objective["prediction_type"], objective["num_train_timesteps"], objective.get("flow_shift", 1.0), args.sampler)
    reference = None
    try:
        cache = LatentCache.load(model_dir / "latent_cache", verify=False)
        reference = torch.stack([cache[i]["latents"] for i in range(min(len(cache), 64))])
    except LatentCacheError:
        pass  # the figures need the training clips; the samples do not
    result = sample_clips(model, scheduler, vae, info["normalization"], tuple(info["latent_shape"]), num_videos=args.num_videos,
                          num_inference_steps=args.num_inference_steps, seed=args.seed,
                          out_dir=args.output_dir or model_dir / "samples", reference_latents=reference, fps=info.get("fps", 8))
    result.pop("frames")
    print(json.dumps({"model": str(transformer), "scheduler": type(scheduler).__name__, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
