"""Record the per-step signals of an unguarded tiny reference-DiT run, and find its failure point.

Why record instead of judging live: every detector in this benchmark (vidstab's and the published
baselines) is a pure function of the per-step signals (loss, pre-clip gradient norm, LR, clip flag,
parameter norm, non-finite flags). Recording a run once and replaying the signals through every detector
compares them on *identical* runs, and makes 20,000 healthy steps affordable on 2 CPU cores.

The loop below is deliberately the plain loop a user has today (forward, backward, clip, AdamW step,
scheduler step; no skipping), built from the reference trainer's own parts: ``VideoDiT``,
``DiffusionObjective`` with per-step seeded noise/timesteps, ``FaultInjector`` with the trainer's fault
grammar, diffusers' ``constant_with_warmup`` schedule, and the built-in moving-shapes latents encoded by
the tiny seeded VAE. fp32 on CPU, single thread: deterministic from (scenario, seed).

Recordings are cached as strict JSON (never pickle) under ``benchmarks/.cache/recordings/``; the file
name carries a hash of everything that determines the run, so a changed config is re-recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from vidstab.files.strict_json import from_json_safe, to_json_safe

from .catalogue import Scenario

#: Bump when the recorder's loop changes what is recorded (invalidates the cache).
RECORDER_VERSION = 2
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache"

#: Failure = first step (at or after the onset) whose loss is non-finite or exceeds FAILURE_FACTOR times
#: the healthy level of that step: the larger of (a) the same seed's healthy run's loss at the same step,
#: which saw the same batch, noise and timesteps, and (b) the median loss of that healthy run over steps
#: [t - W, t + W]. (a) makes the rule immune to batch-to-batch noise (a diffusion loss over 4 clips with
#: random timesteps swings 0.02-0.9 on healthy steps, so the median alone would call noise a failure);
#: (b) keeps a batch whose healthy loss happens to be tiny from turning a small deviation into "x3".
FAILURE_FACTOR = 3.0
HEALTHY_WINDOW = 25


@dataclass(frozen=True)
class TinyRunConfig:
    """The tiny reference run every scenario uses (a few ms per step on one CPU core)."""

    num_videos: int = 64
    """Moving-shapes clips in the built-in latent set."""
    num_frames: int = 9
    """Frames per clip (1 + 4k for the Wan VAE): 3 latent frames."""
    resolution: int = 32
    """Pixels per side: 4x4 latents."""
    latent_channels: int = 4
    """Channels of the tiny seeded VAE."""
    data_seed: int = 0
    """Seed of the clips and of the VAE weights: one fixed latent set for every scenario and seed."""
    hidden_size: int = 32
    """VideoDiT width."""
    num_layers: int = 2
    """VideoDiT blocks."""
    num_heads: int = 2
    """Attention heads (head dim 16)."""
    attention_type: str = "factorized"
    """As in the trainer's tiny config."""
    batch_size: int = 4
    """Clips per optimizer step."""
    learning_rate: float = 3e-4
    """Peak LR (the trainer's default)."""
    warmup_steps: int = 20
    """Linear LR warm-up steps (``constant_with_warmup``)."""
    max_grad_norm: float = 1.0
    """Clipping threshold (the trainer's default); the pre-clip norm is what is recorded."""
    prediction_type: str = "epsilon"
    """Diffusion objective (the trainer's default)."""


#: Columns of a recording, one value per recorded step.
COLUMNS = (
    "step", "loss", "grad_norm", "lr", "clipped", "param_norm", "update_ratio",
    "loss_nonfinite", "params_nonfinite", "input_absmax", "input_nonfinite", "loss_scale",
)


@dataclass(frozen=True)
class StepRecord:
    """The signals of one optimizer step, as any detector would see them after the step's one host read."""

    step: int
    """Optimizer step (0-based)."""
    loss: float
    """Mean loss of the batch (``nan``/``inf`` when non-finite)."""
    grad_norm: float
    """Global pre-clip gradient norm (``nan``/``inf`` when non-finite)."""
    lr: float
    """LR used by this step."""
    clipped: bool
    """Pre-clip norm > ``max_grad_norm``."""
    param_norm: float
    """Global parameter norm after this step's update."""
    update_ratio: float
    """||delta params|| / ||params|| of this step's update."""
    loss_nonfinite: bool
    """The batch loss was NaN/Inf."""
    params_nonfinite: bool
    """Some parameter was NaN/Inf after this step."""
    input_absmax: float
    """Largest finite absolute latent value of the batch."""
    input_nonfinite: int
    """Non-finite latent values in the batch."""
    loss_scale: float | None
    """GradScaler scale (fp16 only; ``None`` here: the CPU recordings are fp32)."""


@dataclass
class Recording:
    """The per-step signals of one unguarded run of a scenario, and where it failed."""

    scenario: str
    """Scenario name."""
    seed: int
    """Training seed (model init, data order, noise and timesteps)."""
    onset: int
    """First step at which the fault can show."""
    faults: list[str]
    """Fault specs injected."""
    init_scale: float
    """Initial weight multiplier."""
    columns: dict[str, list] = field(default_factory=dict)
    """``COLUMNS`` -> one value per recorded step."""
    failure_step: int | None = None
    """First step >= onset that is non-finite or above ``FAILURE_FACTOR`` x the healthy level; ``None``: no failure."""
    failure_reason: str | None = None
    """``"nonfinite"`` or ``"loss x3.4 healthy"``-style text."""
    seconds: float = 0.0
    """Wall time of the recording."""

    def __len__(self) -> int:
        return len(self.columns.get("step", []))

    def rows(self) -> Iterator[StepRecord]:
        """The recorded steps in order."""
        cols = [self.columns[c] for c in COLUMNS]
        for values in zip(*cols):
            yield StepRecord(*values)

    def to_json(self) -> str:
        """Strict JSON: non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        d = dataclasses.asdict(self)
        d["columns"] = to_json_safe(self.columns)
        return json.dumps(d, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "Recording":
        d = json.loads(text)
        d["columns"] = from_json_safe(d["columns"])
        return cls(**d)


# ------------------------------------------------------------------------------------------------------
# The built-in latent set
# ------------------------------------------------------------------------------------------------------
_LATENTS: dict[tuple, torch.Tensor] = {}


def latent_set(cfg: TinyRunConfig = TinyRunConfig(), cache_dir: Path = CACHE_DIR) -> torch.Tensor:
    """All clips' latents ``[N, C, F, H, W]``: moving shapes -> tiny seeded VAE, cached as safetensors."""
    from vidstab.reference.data import moving_shapes_dataset
    from vidstab.reference.vae import build_vae, encode_to_cache

    key = (cfg.num_videos, cfg.num_frames, cfg.resolution, cfg.latent_channels, cfg.data_seed)
    if key not in _LATENTS:
        videos = moving_shapes_dataset(cfg.num_videos, cfg.num_frames, cfg.resolution, seed=cfg.data_seed)
        vae = build_vae(None, seed=cfg.data_seed, latent_channels=cfg.latent_channels)
        cache = encode_to_cache(videos, vae, Path(cache_dir) / "latents" / "-".join(map(str, key)), log=lambda _m: None)
        _LATENTS[key] = torch.stack([cache[i]["latents"] for i in range(len(cache))]).float()
    return _LATENTS[key]


# ------------------------------------------------------------------------------------------------------
# Recording one run
# ------------------------------------------------------------------------------------------------------
#: Source files whose content determines a recording: a change to any of them re-records (a stale cache
#: would silently benchmark yesterday's model). The data and VAE enter through the latents' own digest.
SOURCES = ("vidstab/reference/model.py", "vidstab/reference/objective.py", "vidstab/faults.py",
           "benchmarks/scenarios/recorder.py")
_REPO = Path(__file__).resolve().parents[2]


def source_fingerprint(cfg: TinyRunConfig = TinyRunConfig()) -> str:
    """sha1 over the contents of ``SOURCES`` and the bytes of the latent set."""
    h = hashlib.sha1()
    for rel in SOURCES:
        try:
            h.update((_REPO / rel).read_bytes())
        except OSError:
            h.update(rel.encode())
    h.update(latent_set(cfg).contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def cache_key(scenario: Scenario, seed: int, cfg: TinyRunConfig) -> str:
    """Hash of everything that determines a recording."""
    blob = json.dumps(
        {"v": RECORDER_VERSION, "src": source_fingerprint(cfg), "cfg": dataclasses.asdict(cfg), "faults": list(scenario.faults),
         "init_scale": scenario.init_scale, "steps": scenario.steps, "tail": scenario.tail, "seed": seed,
         "healthy": scenario.healthy, "failure": [FAILURE_FACTOR, HEALTHY_WINDOW]},
        sort_keys=True,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def record(scenario: Scenario, seed: int, cfg: TinyRunConfig = TinyRunConfig(), *, healthy: "Recording | None" = None,
           cache_dir: Path | None = CACHE_DIR, steps: int | None = None) -> Recording:
    """Record ``scenario`` with ``seed`` (from the cache when present).

    ``healthy``: the same seed's healthy recording, needed to place the failure point of a fault run
    (recorded on demand when not given). ``steps`` overrides ``scenario.steps`` (smoke tests).
    """
    if steps is not None:
        scenario = dataclasses.replace(scenario, steps=steps)
    if scenario.prediction_type != cfg.prediction_type:
        cfg = dataclasses.replace(cfg, prediction_type=scenario.prediction_type)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / "recordings" / f"{scenario.name}-s{seed}-{cache_key(scenario, seed, cfg)}.json"
        if path.is_file():
            try:
                return Recording.from_json(path.read_text())
            except (ValueError, KeyError, TypeError):
                pass  # a damaged cache file is simply re-recorded
    if not scenario.healthy and healthy is None:
        from .catalogue import HEALTHY

        healthy = record(HEALTHY.variant(scenario.prediction_type, max(HEALTHY.steps, scenario.steps)), seed, cfg,
                         cache_dir=cache_dir)
    rec = _run(scenario, seed, cfg, healthy)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(rec.to_json())
        tmp.replace(path)
    return rec


def _run(scenario: Scenario, seed: int, cfg: TinyRunConfig, healthy: Recording | None) -> Recording:
    import time

    from diffusers.optimization import get_scheduler

    from vidstab.faults import FaultInjector
    from vidstab.reference.model import VideoDiT
    from vidstab.reference.objective import DiffusionObjective, ObjectiveConfig, step_generator

    started = time.time()
    torch.manual_seed(seed)
    latents_all = latent_set(cfg)
    model = VideoDiT(
        in_channels=latents_all.shape[1], hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, attention_type=cfg.attention_type,
    )
    if scenario.init_scale != 1.0:
        with torch.no_grad():  # the over-scaled-initialisation fault: every weight (zero-init ones stay 0)
            for p in model.parameters():
                p.mul_(scenario.init_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    objective = DiffusionObjective(ObjectiveConfig(prediction_type=cfg.prediction_type))
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=scenario.steps)
    faults = FaultInjector(list(scenario.faults), rank=0)
    n = latents_all.shape[0]
    per_epoch = n // cfg.batch_size
    order: list[int] = []

    cols: dict[str, list] = {c: [] for c in COLUMNS}
    failure_step, failure_reason, stop_at = None, None, scenario.steps
    params_bad_since = None
    for step in range(scenario.steps):
        if step >= stop_at:
            break
        epoch, index = divmod(step, per_epoch)
        if index == 0:  # a seeded shuffle per epoch, like the trainer's seedable sampler
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        latents = latents_all[order[index * cfg.batch_size:(index + 1) * cfg.batch_size]]
        faults.adjust_lr(step, optimizer, scheduler)
        lr = optimizer.param_groups[0]["lr"]
        latents, _ = faults.corrupt_batch(step, latents)
        finite_in = torch.isfinite(latents)
        input_nonfinite = int((~finite_in).sum())
        input_absmax = float(latents[finite_in].abs().max()) if finite_in.any() else 0.0
        draws = objective.sample(latents, step_generator(seed, step, 0, 0))
        with faults.module_fault(step, model):
            loss = objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        before = [p.detach().clone() for p in params]
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            param_sq = sum(float(p.double().pow(2).sum()) for p in params)
            update_sq = sum(float((p.double() - b.double()).pow(2).sum()) for p, b in zip(params, before))
        param_norm = math.sqrt(param_sq) if math.isfinite(param_sq) else math.nan
        loss_value = float(loss.detach())
        row = {
            "step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
            "clipped": bool(math.isfinite(grad_norm) and grad_norm > cfg.max_grad_norm),
            "param_norm": param_norm,
            "update_ratio": math.sqrt(update_sq) / param_norm if math.isfinite(update_sq) and param_norm > 0 else math.nan,
            "loss_nonfinite": not math.isfinite(loss_value), "params_nonfinite": not math.isfinite(param_sq),
            "input_absmax": input_absmax, "input_nonfinite": input_nonfinite, "loss_scale": None,
        }
        for c in COLUMNS:
            cols[c].append(row[c])
        if failure_step is None and not scenario.healthy and step >= scenario.onset:
            reason = _failure_reason(step, loss_value, healthy)
            if reason is not None:
                failure_step, failure_reason = step, reason
                stop_at = min(stop_at, step + 1 + scenario.tail)
        if row["params_nonfinite"]:
            params_bad_since = step if params_bad_since is None else params_bad_since
            if step - params_bad_since >= 5:
                break  # NaN weights: every later step is NaN too; nothing left to record
    rec = Recording(scenario.name, seed, scenario.onset, list(scenario.faults), scenario.init_scale, cols,
                    failure_step, failure_reason, round(time.time() - started, 2))
    return rec


def healthy_level(healthy: Recording, step: int, window: int = HEALTHY_WINDOW) -> float:
    """Median finite loss of the healthy run over steps [step - window, step + window]."""
    losses = healthy.columns["loss"]
    lo, hi = max(0, step - window), min(len(losses), step + window + 1)
    if lo >= hi:  # beyond the healthy recording: its last window
        lo, hi = max(0, len(losses) - 2 * window - 1), len(losses)
    vals = [v for v in losses[lo:hi] if math.isfinite(v)]
    return statistics.median(vals) if vals else math.nan


def _failure_reason(step: int, loss: float, healthy: Recording | None) -> str | None:
    if not math.isfinite(loss):
        return "nonfinite loss"
    if healthy is None:
        return None
    level = healthy_level(healthy, step)
    paired = healthy.columns["loss"][step] if step < len(healthy) else math.nan
    if math.isfinite(paired):
        level = max(level, paired) if math.isfinite(level) else paired
    if math.isfinite(level) and loss > FAILURE_FACTOR * level:
        return f"loss {loss:.4g} = x{loss / level:.1f} healthy level {level:.4g}"
    return None


def healthy_exceedances(healthy: Recording) -> int:
    """Steps of a healthy run whose loss is above ``FAILURE_FACTOR`` x the rolling median alone.

    Why the failure rule also pairs each step with the healthy run's loss on the same batch: with the
    median alone, this many healthy steps would already count as failures (reported in RESULTS.md).
    """
    out = 0
    for r in healthy.rows():
        level = healthy_level(healthy, r.step)
        out += bool(math.isfinite(r.loss) and math.isfinite(level) and r.loss > FAILURE_FACTOR * level)
    return out
