"""A bucketed video-diffusion workload as a new user runs it, guarded by vidstab through its public API only.

A tiny diffusers ``WanTransformer3DModel`` (built from a config, CPU, fp32) trained with flow matching
(rectified flow: ``x_t = (1 - t) x0 + t noise``, target ``noise - x0``) on synthetic latents of several
latent (frames, height, width) buckets, each with its own batch size so that every optimizer step sees about
the same number of tokens; AdamW, warm-up + cosine LR, gradient clipping at 1.0, a plain Accelerate loop with
``vidstab.attach`` (or the explicit ``guard.backward``/``guard.step`` calls, optionally with ``bucket=``).

Schedules (which bucket each step draws from): ``random`` (a uniform random mix), ``low_to_high`` (the
lowest-resolution bucket first, then a switch to the highest: a resolution curriculum) and ``batch_switch``
(one resolution, then a switch to a smaller batch size). Faults are injected at a chosen step inside a chosen
bucket: ``nan_sample`` (one sample's latents NaN), ``lr_x1000`` (the param groups' LR x1000 for one step,
written by the loop), ``latents_x5`` (every latent x5 from that step on: a dropped VAE scaling factor).

Seeds: :data:`TUNING_SEEDS` may be looked at to choose anything (fault steps, buckets, thresholds);
:data:`HELDOUT_SEEDS` are only replayed once the choices are frozen; :data:`HELDOUT2_SEEDS` too, drawn after the
last change that a held-out figure led to (so the first draw no longer says how the changed guard does).
"""

from __future__ import annotations

import inspect
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
import torch
import torch.nn.functional as F

#: Seeds that may be looked at to choose anything in this workload or in the guard.
TUNING_SEEDS = (500, 501, 502)
#: Seeds only replayed after every choice is frozen (disjoint from the tuning seeds and every other split).
HELDOUT_SEEDS = (600, 601, 602)
#: A second held-out draw, never looked at before the guard it reports was frozen.
HELDOUT2_SEEDS = (700, 701, 702)
SPLITS = {"tuning": TUNING_SEEDS, "heldout": HELDOUT_SEEDS, "heldout2": HELDOUT2_SEEDS}

LATENT_CHANNELS = 4
TEXT_TOKENS = 8
TEXT_DIM = 16
POOL_BATCHES = 6  # samples in a bucket's pool: this many of its batches


@dataclass(frozen=True)
class Bucket:
    """One latent (frames, height, width) bucket and its batch size."""

    frames: int
    height: int
    width: int
    batch: int

    @property
    def key(self) -> str:
        """The bucket key a loop passes to ``guard.backward(..., bucket=...)``."""
        return f"f{self.frames}h{self.height}w{self.width}b{self.batch}"

    @property
    def tokens(self) -> int:
        """Transformer tokens of one batch (patch size (1, 2, 2))."""
        return self.batch * self.frames * (self.height // 2) * (self.width // 2)


#: Token-balanced buckets (576 tokens per batch each), lowest resolution first.
BUCKETS = (Bucket(2, 8, 8, 18), Bucket(2, 12, 12, 8), Bucket(3, 16, 16, 3), Bucket(4, 24, 24, 1))
#: The batch-size switch: the second bucket's resolution at a quarter of its batch size.
BATCH_SWITCH = (BUCKETS[1], Bucket(2, 12, 12, 2))

SCHEDULES = ("random", "low_to_high", "batch_switch")
FAULTS = ("nan_sample", "lr_x1000", "latents_x5")


@dataclass(frozen=True)
class Fault:
    """A fault at the first step ``>= at`` whose bucket is ``bucket`` (an index into the schedule's buckets)."""

    kind: str
    at: int
    bucket: int
    window: int | None = None
    """Steps a ``latents_x5`` fault lasts (``None``: the rest of the run)."""

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.at}/b{self.bucket}"


@dataclass
class RunSpec:
    """One run of the workload."""

    schedule: str
    seed: int
    steps: int
    fault: Fault | None = None
    loop: str = "attached"
    """``attached`` (the user's own ``accelerator.backward``/``optimizer.step``), ``explicit``
    (``guard.backward``/``guard.step``, the bucket key left to the guard) or ``explicit_bucket`` (the same with
    ``bucket=Bucket.key``)."""
    switch_at: float = 0.5
    """Fraction of the run after which ``low_to_high`` and ``batch_switch`` switch."""
    tail: int = 10
    """A fault run stops this many steps after the fault."""
    lr: float = 5e-4
    warmup: int = 50


@dataclass
class StepRecord:
    """What one optimizer step was and what the guard decided (from its ``StepResult``)."""

    step: int
    bucket: int
    key: str
    verdict: str
    findings: list[tuple[str, str]]
    grad_norm: float
    loss: float
    fault: bool = False


@dataclass
class RunRecord:
    spec: RunSpec
    buckets: tuple[Bucket, ...]
    steps: list[StepRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    """The run's warn / skip / rollback_request events from ``RUN_DIR/vidstab/events-rank0.jsonl``."""
    fault_step: int | None = None
    seconds: float = 0.0
    aborted: str | None = None
    """The guard's message when it ended the run (vidstab.RunAborted), else None."""


def schedule_buckets(schedule: str) -> tuple[Bucket, ...]:
    return BATCH_SWITCH if schedule == "batch_switch" else BUCKETS


def bucket_sequence(schedule: str, steps: int, seed: int, switch_at: float = 0.5) -> list[int]:
    """The bucket index of every step (indices into :func:`schedule_buckets`)."""
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    switch = int(steps * switch_at)
    if schedule == "random":
        return torch.randint(0, len(BUCKETS), (steps,), generator=g).tolist()
    if schedule == "low_to_high":
        return [0 if i < switch else len(BUCKETS) - 1 for i in range(steps)]
    if schedule == "batch_switch":
        return [0 if i < switch else 1 for i in range(steps)]
    raise ValueError(f"unknown schedule {schedule!r}; one of {SCHEDULES}")


def fault_step(sequence: list[int], fault: Fault) -> int:
    """The first step ``>= fault.at`` of the fault's bucket."""
    for i in range(fault.at, len(sequence)):
        if sequence[i] == fault.bucket:
            return i
    raise ValueError(f"no step of bucket {fault.bucket} at or after step {fault.at}")


def smooth_latents(n: int, bucket: Bucket, g: torch.Generator) -> torch.Tensor:
    """``n`` unit-RMS latents of the bucket's shape: low-frequency fields plus a little fine detail."""
    c, f, h, w = LATENT_CHANNELS, bucket.frames, bucket.height, bucket.width
    coarse = torch.randn(n, c, max(f // 2, 1), max(h // 4, 2), max(w // 4, 2), generator=g)
    x = F.interpolate(coarse, size=(f, h, w), mode="trilinear", align_corners=False)
    x = x + 0.2 * torch.randn(n, c, f, h, w, generator=g)
    x = x + 0.3 * torch.randn(1, c, 1, 1, 1, generator=g)  # per-channel offsets shared by the bucket's samples
    return x / x.pow(2).mean(dim=(1, 2, 3, 4), keepdim=True).sqrt()


class BucketData:
    """Per-bucket pools of latents and text embeddings; batches drawn at random from a bucket's pool."""

    def __init__(self, buckets: tuple[Bucket, ...], seed: int):
        g = torch.Generator().manual_seed(seed * 104729 + 3)
        self.buckets = buckets
        self.latents = [smooth_latents(b.batch * POOL_BATCHES, b, g) for b in buckets]
        self.text = [torch.randn(b.batch * POOL_BATCHES, TEXT_TOKENS, TEXT_DIM, generator=g) for b in buckets]
        self.draw = torch.Generator().manual_seed(seed * 15485863 + 5)

    def batch(self, bucket: int) -> dict[str, torch.Tensor]:
        b = self.buckets[bucket]
        idx = torch.randperm(len(self.latents[bucket]), generator=self.draw)[: b.batch]
        x0 = self.latents[bucket][idx].clone()
        noise = torch.randn(x0.shape, generator=self.draw)
        t = torch.sigmoid(torch.randn(b.batch, generator=self.draw))  # logit-normal timesteps (SD3, Wan)
        return {"latents": x0, "noise": noise, "t": t, "text": self.text[bucket][idx], "ids": idx}


def build_model(seed: int) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
        rope_max_seq_len=64,
    )


def guard_accepts_bucket() -> bool:
    """Whether ``guard.backward`` takes a ``bucket=`` keyword (the bucket-aware guard)."""
    from vidstab import Guard

    return "bucket" in inspect.signature(Guard.backward).parameters


def run(spec: RunSpec, run_dir: str | Path | None = None) -> RunRecord:
    """Train one run of the workload in this process (one CPU ``Accelerator``) and record every step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from diffusers.optimization import get_cosine_schedule_with_warmup

    import vidstab

    buckets = schedule_buckets(spec.schedule)
    sequence = bucket_sequence(spec.schedule, spec.steps, spec.seed, spec.switch_at)
    at = fault_step(sequence, spec.fault) if spec.fault else None
    steps = min(spec.steps, at + spec.tail + 1) if at is not None else spec.steps
    own_dir = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="vidstab-buckets-")) if own_dir else Path(run_dir)
    record = RunRecord(spec, buckets, fault_step=at)
    AcceleratorState._reset_state(True)
    torch.manual_seed(spec.seed)
    started = time.perf_counter()
    try:
        accelerator = Accelerator(cpu=True)
        model = build_model(spec.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        lr_scheduler = get_cosine_schedule_with_warmup(optimizer, spec.warmup, spec.steps)
        model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
        guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=str(run_dir), seed=spec.seed)
        data = BucketData(buckets, spec.seed)
        try:
            for step in range(steps):
                bucket = sequence[step]
                batch = data.batch(bucket)
                faulty = at is not None and step >= at and (
                    step == at or (spec.fault.kind == "latents_x5"
                                   and (spec.fault.window is None or step < at + spec.fault.window)))
                if faulty and spec.fault.kind == "nan_sample":
                    batch["latents"][0] = float("nan")
                if faulty and spec.fault.kind == "latents_x5":
                    batch["latents"] = batch["latents"] * 5.0
                result = train_step(accelerator, model, optimizer, lr_scheduler, guard, batch, buckets[bucket],
                                    spec.loop, lr_x1000=faulty and spec.fault.kind == "lr_x1000")
                record.steps.append(StepRecord(
                    step, bucket, buckets[bucket].key, result.verdict.name,
                    [(f.detector, f.verdict.name) for f in result.findings], float(result.grad_norm),
                    float(result.loss), fault=faulty))
        except vidstab.RunAborted as e:  # skipping could not get past the fault: the attached guard ended the run
            record.aborted = str(e)
        guard.close()
        record.events = vidstab.read_events(run_dir, kinds=("warn", "skip", "rollback_request"))
    finally:
        record.seconds = time.perf_counter() - started
        AcceleratorState._reset_state(True)
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return record


def train_step(accelerator, model, optimizer, lr_scheduler, guard, batch, bucket: Bucket, loop: str,
               lr_x1000: bool = False):
    """One optimizer step of the user's loop; the guard's ``StepResult`` of it."""
    x0, noise, t = batch["latents"], batch["noise"], batch["t"]
    tt = t.view(-1, 1, 1, 1, 1)
    x_t = (1 - tt) * x0 + tt * noise
    pred = model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=batch["text"], return_dict=False)[0]
    loss = F.mse_loss(pred.float(), (noise - x0).float())
    saved = None
    if lr_x1000:  # an LR bug in the loop: written after the scheduler, before this step's update
        saved = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * 1000
    if loop == "attached":
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result = guard.last_result
    else:  # guard.step clips, steps the optimizer and the LR scheduler, and zeroes the gradients
        kwargs = {"bucket": bucket.key} if loop == "explicit_bucket" else {}
        guard.backward(loss, batch={"latents": x0, "noise": noise}, sample_ids=batch["ids"], timesteps=t * 1000,
                       **kwargs)
        result = guard.step(1.0)
    if saved is not None:  # undone unless a scheduler step has already set the next LR
        for g, lr in zip(optimizer.param_groups, saved):
            if g["lr"] == lr * 1000:
                g["lr"] = lr
    if loop == "attached":
        lr_scheduler.step()
        optimizer.zero_grad()
    return result


# ---------------------------------------------------------------------------------------------- summaries
def healthy_counts(records: list[RunRecord]) -> dict:
    """SKIP / ROLLBACK counts and warnings per 1,000 steps (by detector) over healthy runs, from the event log."""
    steps = sum(len(r.steps) for r in records)
    kinds = {"warn": 0, "skip": 0, "rollback_request": 0}
    by_detector: dict[str, int] = {}
    alarms = []
    for r in records:
        for e in r.events:
            kinds[e["kind"]] += 1
            if e["kind"] == "warn":
                by_detector[e.get("detector", "?")] = by_detector.get(e.get("detector", "?"), 0) + 1
            alarms.append({"seed": r.spec.seed, "step": e.get("step"), "kind": e["kind"],
                           "detector": e.get("detector"), "message": str(e.get("message", ""))[:160]})
    return {
        "steps": steps, "skip": kinds["skip"], "rollback": kinds["rollback_request"], "warn": kinds["warn"],
        "warn_per_1k": 1000.0 * kinds["warn"] / steps if steps else math.nan,
        "warn_by_detector": dict(sorted(by_detector.items())), "alarms": alarms,
    }


def first_step_verdict(record: RunRecord) -> dict:
    """The guard's verdict and findings at the fault's first step, and the first step with any finding."""
    at = record.fault_step
    s = record.steps[at]
    later = next((x.step for x in record.steps[at:] if x.findings), None)
    earlier = [x.step for x in record.steps[:at] if x.findings]
    return {"fault": record.spec.fault.name, "seed": record.spec.seed, "step": at, "bucket": s.key,
            "verdict": s.verdict, "detectors": sorted({d for d, _ in s.findings}),
            "first_finding_step": later, "findings_before": len(earlier)}


def bucket_figures(records: list[RunRecord]) -> dict[str, dict]:
    """Per bucket: applied steps, median pre-clip grad norm and the share of steps clipped (norm > 1.0)."""
    norms: dict[str, list[float]] = {}
    for r in records:
        for s in r.steps:
            if math.isfinite(s.grad_norm) and s.verdict in ("OK", "WARN"):
                norms.setdefault(s.key, []).append(s.grad_norm)
    out = {}
    for key, xs in norms.items():
        xs = sorted(xs)
        out[key] = {"steps": len(xs), "median_grad_norm": xs[len(xs) // 2],
                    "clip_rate": sum(x > 1.0 for x in xs) / len(xs)}
    return out



def audit_factory() -> dict:
    """``vidstab audit --model benchmarks.scenarios.buckets:audit_factory --memory``: the workload's model and one
    batch of each bucket (its micro-batch), as the model's keyword inputs."""
    data = BucketData(BUCKETS, TUNING_SEEDS[0])
    buckets = {}
    for i, bucket in enumerate(BUCKETS):
        batch = data.batch(i)
        buckets[bucket.key] = {"hidden_states": batch["latents"], "timestep": batch["t"] * 1000,
                               "encoder_hidden_states": batch["text"], "return_dict": False}
    return {"model": build_model(TUNING_SEEDS[0]), "example_inputs": buckets[BUCKETS[-1].key], "buckets": buckets}
