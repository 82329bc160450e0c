"""Sampling clips from a trained VideoDiT with diffusers schedulers, and writing them where a user looks.

- :func:`make_scheduler`: the sampler that matches the training objective -- ``DDIMScheduler`` (or
  ``DDPMScheduler``) with the same betas for epsilon / v-prediction, ``FlowMatchEulerDiscreteScheduler`` with
  the same shift for flow matching (the model predicts the velocity ``noise - x0`` the Euler step expects).
- :func:`sample_latents`: the standard diffusers denoising loop (``scale_model_input`` -> model -> ``step``).
- :func:`nearest_data_distance`: what a tiny random VAE cannot show in pixels, shown as a number -- how far
  each sampled latent clip is from the nearest data clip. Gaussian noise (where sampling starts) is far from
  every clip; a model that learned the moving shapes lands near them. :func:`latent_statistics` adds
  per-channel mean/std and frame-to-frame / pixel-to-pixel correlation.
- :func:`decode_to_frames`, :func:`write_video` (PyAV), :func:`write_strip` (PNG: one row per clip).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

SAMPLERS = ("ddim", "ddpm")


def make_scheduler(prediction_type: str, num_train_timesteps: int, flow_shift: float = 1.0, sampler: str = "ddpm"):
    """The diffusers scheduler that samples what the objective (``vidstab.reference.objective``) trained."""
    from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler

    if prediction_type == "flow_matching":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=flow_shift)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    # Same (default, linear) betas as the DDPMScheduler the objective trains with; no x0 clipping: latents
    # are normalised to unit std, not bounded to [-1, 1]. DDPM is the default: with these betas the final
    # alpha_bar is ~4e-5, so DDIM's deterministic x0 estimate at the first steps magnifies a small model's
    # epsilon error ~150x (measured on the tiny default run: DDIM samples at std ~5, DDPM at ~0.85).
    if sampler == "ddpm":
        return DDPMScheduler(num_train_timesteps=num_train_timesteps, prediction_type=prediction_type, clip_sample=False)
    return DDIMScheduler(num_train_timesteps=num_train_timesteps, prediction_type=prediction_type, clip_sample=False,
                         timestep_spacing="trailing", set_alpha_to_one=True)


@torch.no_grad()
def sample_latents(model: torch.nn.Module, scheduler, shape: tuple[int, ...], num_inference_steps: int,
                   generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Denoise Gaussian noise of ``shape`` ([B, C, F, H, W]) in ``num_inference_steps``; float32 on ``device``."""
    scheduler.set_timesteps(num_inference_steps, device=device)
    latents = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32).to(device)
    latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching starts at unit noise
    dtype = next(model.parameters()).dtype
    for t in scheduler.timesteps:
        scale = getattr(scheduler, "scale_model_input", None)
        model_input = scale(latents, t) if scale is not None else latents
        prediction = model(model_input.to(dtype), t.expand(shape[0]).to(device)).float()
        latents = scheduler.step(prediction, t, latents).prev_sample
    return latents


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-12))


def latent_statistics(latents: torch.Tensor) -> dict:
    """Summary of normalised latents ``[N, C, F, H, W]``: channel mean/std, temporal and spatial correlation."""
    x = latents.float()
    stats = {
        "channel_mean": [round(float(v), 4) for v in x.mean(dim=(0, 2, 3, 4))],
        "channel_std": [round(float(v), 4) for v in x.std(dim=(0, 2, 3, 4))],
        "spatial_corr": round(_corr(x[..., :-1], x[..., 1:]), 4) if x.shape[-1] > 1 else None,
    }
    stats["temporal_corr"] = round(_corr(x[:, :, :-1], x[:, :, 1:]), 4) if x.shape[2] > 1 else None
    return stats


def nearest_data_distance(latents: torch.Tensor, data: torch.Tensor, leave_one_out: bool = False) -> float:
    """Mean over clips of the RMS distance (per latent value) to the nearest clip of ``data`` ([N, ...] each).

    The figure that tells a model that learned the data from one that did not, even through a random VAE:
    Gaussian noise sits far from every data clip, a good sample close to one. ``leave_one_out`` (``latents``
    is ``data``) gives the data's own spacing, the level a model reaches when it learned the distribution.
    """
    a, b = latents.flatten(1).double().cpu(), data.flatten(1).double().cpu()
    dist = torch.cdist(a, b)
    if leave_one_out:
        dist.fill_diagonal_(float("inf"))
    return round(float(dist.min(dim=1).values.mean() / a.shape[1] ** 0.5), 4)


@torch.no_grad()
def decode_to_frames(vae, latents: torch.Tensor) -> np.ndarray:
    """VAE latents (already denormalised) ``[B, C, F', H', W']`` -> uint8 RGB frames ``[B, T, H, W, 3]``."""
    param = next(vae.parameters())
    video = vae.decode(latents.to(device=param.device, dtype=param.dtype)).sample.float()  # [B, 3, T, H, W] in ~[-1, 1]
    video = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return video.permute(0, 2, 3, 4, 1).cpu().numpy()


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: int = 8) -> Path:
    """Write uint8 ``[T, H, W, 3]`` frames as an H.264 MP4 with PyAV (sides padded to even for yuv420p)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.mp4")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


def strip_image(videos: np.ndarray, scale: int = 2) -> np.ndarray:
    """uint8 ``[B, T, H, W, 3]`` -> one ``[B*H*scale, T*W*scale, 3]`` image: a row of frames per clip."""
    b, t, h, w, c = videos.shape
    grid = videos.transpose(0, 2, 1, 3, 4).reshape(b * h, t * w, c)
    return grid.repeat(scale, axis=0).repeat(scale, axis=1)


def write_strip(path: str | os.PathLike, videos: np.ndarray, scale: int = 2) -> Path:
    """Write :func:`strip_image` of ``videos`` as a PNG (atomically)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    Image.fromarray(strip_image(videos, scale)).save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def sample_clips(model: torch.nn.Module, scheduler, vae, normalization: dict, latent_shape: tuple[int, ...], *,
                 num_videos: int, num_inference_steps: int, seed: int, out_dir: str | os.PathLike,
                 reference_latents: torch.Tensor | None = None, fps: int = 8) -> dict:
    """Sample ``num_videos`` clips, decode them with ``vae`` and write ``clip_XX.mp4`` + ``strip.png`` to ``out_dir``.

    Returns ``{"videos": [paths], "strip": path, "stats": latent statistics of the samples, "frames": uint8
    [B, T, H, W, 3]}`` and, with ``reference_latents`` (normalised data latents), the learning figures of
    :func:`nearest_data_distance`: ``nn_distance`` (samples), ``noise_nn_distance`` (Gaussian noise, what an
    untrained sampler starts from) and ``data_nn_distance`` (the data's own spacing).
    """
    from vidstab.reference.vae import denormalize_latents

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)  # same seed each time: clips comparable across steps
    was_training = model.training
    model.eval()
    try:
        latents = sample_latents(model, scheduler, (num_videos, *latent_shape), num_inference_steps, generator, device)
    finally:
        model.train(was_training)
    frames = decode_to_frames(vae, denormalize_latents(latents, normalization))
    out_dir = Path(out_dir)
    videos = [write_video(out_dir / f"clip_{i:02d}.mp4", clip, fps=fps) for i, clip in enumerate(frames)]
    result = {
        "videos": [str(v) for v in videos],
        "strip": str(write_strip(out_dir / "strip.png", frames)),
        "stats": latent_statistics(latents.cpu()),
        "frames": frames,
    }
    if reference_latents is not None:
        noise = torch.randn((len(reference_latents), *latent_shape), generator=torch.Generator().manual_seed(seed))
        result["nn_distance"] = nearest_data_distance(latents, reference_latents)
        result["noise_nn_distance"] = nearest_data_distance(noise, reference_latents)
        result["data_nn_distance"] = nearest_data_distance(reference_latents, reference_latents, leave_one_out=True)
    return result
