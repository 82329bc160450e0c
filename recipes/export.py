"""End of a run: a diffusers-style folder a user can ``from_pretrained`` and ``recipes/sample.py`` can sample.

    OUTPUT_DIR/transformer/       VideoDiT.save_pretrained (config.json + diffusion_pytorch_model.safetensors)
    OUTPUT_DIR/transformer_ema/   the EMA weights, with --use_ema
    OUTPUT_DIR/vae/               the run's VAE (the tiny random one by default), or named in sampling.json
    OUTPUT_DIR/scheduler/         the diffusers scheduler that samples this objective
    OUTPUT_DIR/sampling.json      latent shape and normalisation (what turns samples back into VAE latents)

Each folder is written next to its final place and renamed, so a crash never leaves half a model there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from vidstab.files.atomic import write_json_atomic
from vidstab.reference.sampling import make_scheduler

SAMPLING_FILE = "sampling.json"


def _save_folder(obj, folder: Path) -> Path:
    """``obj.save_pretrained`` into ``folder`` through a temporary sibling and a rename."""
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    obj.save_pretrained(str(tmp))
    old = folder.with_name(f".{folder.name}.old{os.getpid()}")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def ema_copy(model: torch.nn.Module, ema) -> torch.nn.Module:
    """A copy of ``model`` holding the EMA weights (``diffusers.training_utils.EMAModel``)."""
    # A fresh instance from the config, not a deepcopy: the live model carries hooks (the guard's forward
    # pre-hook holds the event log's open file) that must not be copied.
    averaged = type(model).from_config(model.config)
    averaged.load_state_dict(model.state_dict())
    averaged.to(next(model.parameters()).device)
    ema.copy_to(averaged.parameters())
    return averaged


def export_pipeline(output_dir: str | os.PathLike, model, *, ema, vae, vae_path: str | None, objective: dict,
                    normalization: dict, latent_shape: tuple[int, ...], fps: int = 8) -> dict:
    """Write the folders above; returns ``{name: path}`` of what was written."""
    out = Path(output_dir)
    written = {"transformer": _save_folder(model, out / "transformer")}
    if ema is not None:
        written["transformer_ema"] = _save_folder(ema_copy(model, ema), out / "transformer_ema")
    if vae_path is None:
        written["vae"] = _save_folder(vae, out / "vae")
    scheduler = make_scheduler(objective["prediction_type"], objective["num_train_timesteps"], objective.get("flow_shift", 1.0))
    written["scheduler"] = _save_folder(scheduler, out / "scheduler")
    write_json_atomic(out / SAMPLING_FILE, {
        "vae": "vae" if vae_path is None else str(Path(vae_path).resolve()),
        "latent_shape": list(latent_shape),
        "normalization": normalization,
        "objective": objective,
        "fps": fps,
    }, indent=2)
    written["sampling"] = out / SAMPLING_FILE
    return {k: str(v) for k, v in written.items()}
