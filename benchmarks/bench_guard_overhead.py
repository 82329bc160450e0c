"""Claim: the guarded reference video DiT step takes <= 1.01x the plain step; the small models' added time is reported.

Three models for three step sizes (about 3 ms, 10 ms and 100 ms on a GPU): a small MLP, a small transformer
encoder, and the reference video DiT (``vidstab.reference.model.VideoDiT``) on 8 latent frames. The DiT is the
gated figure (``--dit_seconds``: a longer budget, since its A/A noise is most of the 1% it gates); the small
models' added time is printed beside it without a target (on a GPU the guard's host work overlaps the queued
kernels, which a CPU step cannot show). ``--dit_frames 4`` runs a shorter DiT step, where the guard's fixed cost
is a larger fraction (``benchmarks/RESULTS.md`` has the measured figures).

For each, five variants of the same Accelerate training step (AdamW, clipping at 1.0, a constant LR
scheduler):

* ``plain``     - the user's loop: ``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step``,
  ``lr_scheduler.step``, ``optimizer.zero_grad``;
* ``attached``  - exactly that loop after ``vidstab.attach(...)`` (the one-line integration);
* ``explicit``  - ``guard.backward(loss, batch=...)`` + ``guard.step`` (the trainer's way: input statistics
  of every floating tensor of the batch, timestep-bucket losses);
* ``seed``      - the widespread baseline: ``if not torch.isfinite(loss)`` and ``check_gradients`` summing
  ``p.grad.norm().item() ** 2`` per parameter (one host sync per parameter tensor), then the plain step;
* ``plain_again`` - ``plain`` once more in the round (A/A): what the method reads when nothing is added.

All variants train ONE model, optimizer, scheduler and ``Accelerator`` (the same tensors at the same
addresses: separate copies of the DiT differ between two *plain* variants by as much as the guard costs). ``attached`` runs the user's calls through the instances ``vidstab.attach``
wrapped; ``plain`` and ``seed`` call the originals it saved, on the model without the attached guard's
forward pre-hook (removed and put back between steps, outside the timing); ``explicit`` is a second guard,
built before the attach and never wrapped. The variants run interleaved, one step each per round in a random
order, so drift and the load of a shared machine hit all alike. Reported per model: the median step time,
the median of the per-round paired difference to ``plain`` (the added time; wall clock, and this thread's CPU
time, which the load of other processes on a shared machine inflates least) with a 95% bootstrap interval, the
mean of the thread-CPU differences (work done once every n steps, such as encoding the buffered metrics lines, is
in the mean and not in the median), the paired ratio ``1 + added / plain median`` and the ratio of medians;
host reads per optimizer step (``Tensor.item/tolist/...`` calls) for all variants. Last line: one JSON
object.

    python benchmarks/bench_guard_overhead.py            # CPU, about 7 minutes
    python benchmarks/bench_guard_overhead.py --quick    # smoke run (CI)
    python benchmarks/bench_guard_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time

import torch
from accelerate import Accelerator

import vidstab

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
VARIANTS = ("plain", "attached", "explicit", "seed", "plain_again")
#: ``plain_again`` is the plain step once more in the same round: its paired difference to ``plain`` is the
#: method's own noise floor (an A/A comparison), printed beside the others.


@contextlib.contextmanager
def count_reads(counter: dict):
    """Count device->host reads by wrapping the Tensor methods that make them (observing only)."""
    originals = {n: getattr(torch.Tensor, n) for n in READS}

    def wrap(fn):
        def inner(*a, **k):
            counter["n"] += 1
            return fn(*a, **k)
        return inner

    for n, fn in originals.items():
        setattr(torch.Tensor, n, wrap(fn))
    try:
        yield counter
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)


class MLPDenoiser(torch.nn.Module):
    """A small MLP on flattened latents (the ~3 ms case: LoRA-sized updates, fast GPUs)."""

    def __init__(self, dim: int, width: int, depth: int) -> None:
        super().__init__()
        layers = [torch.nn.Linear(dim + 1, width), torch.nn.GELU()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        return self.net(torch.cat([flat, t.float()[:, None] / 1000.0], 1)).reshape(x.shape)


class TransformerDenoiser(torch.nn.Module):
    """A small transformer encoder over latent tokens (the ~10 ms case)."""

    def __init__(self, channels: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(channels, hidden)
        self.time = torch.nn.Linear(1, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, 4, 2 * hidden, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = torch.nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        tokens = x.flatten(2).transpose(1, 2)
        h = self.inp(tokens) + self.time(t.float()[:, None] / 1000.0)[:, None, :]
        return self.out(self.blocks(h)).transpose(1, 2).reshape(x.shape)


def build(kind: str, quick: bool, dit_frames: int = 4):
    """(model factory, latent shape, description) of one size class (``dit_frames``: the DiT's latent frames)."""
    if kind == "mlp":
        shape = (8, 4, 2, 8, 8)
        return lambda: MLPDenoiser(4 * 2 * 8 * 8, 128, 2), shape, "MLP 512-128-128-512"
    if kind == "transformer":
        shape = (4, 4, 2, 8, 8)
        return lambda: TransformerDenoiser(4, 64, 1), shape, "transformer encoder, hidden 64, 1 layer, 128 tokens"
    from vidstab.reference.model import VideoDiT

    shape = (2, 4, 4, 8, 8) if quick else (2, 4, dit_frames, 16, 16)
    return (lambda: VideoDiT(in_channels=4, hidden_size=96, num_layers=4, num_heads=4, patch_size=(1, 2, 2)),
            shape, "reference VideoDiT, hidden 96, 4 blocks")


def prepared_training(accelerator: Accelerator, factory):
    """(model, optimizer, scheduler) of one size class, prepared: seeded weights, AdamW at 1e-4, a constant LR."""
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return accelerator.prepare(model, opt, sched)


def fixed_batches(shape: tuple[int, ...], device: torch.device | str = "cpu", n: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """``n`` seeded ``(latents, noise, timesteps)`` batches, cycled through by every variant."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device),
             torch.randint(0, 1000, (shape[0],), generator=g).to(device)) for _ in range(n)]


def user_loop_step(accelerator: Accelerator, model, opt, sched, batch: tuple[torch.Tensor, ...]) -> None:
    """One optimizer step of the user's own Accelerate loop on one ``(latents, noise, timesteps)`` batch: what
    ``vidstab.attach`` guards as it is (``bench_guard_ddp.py`` runs it)."""
    x, noise, t = batch
    with accelerator.accumulate(model):
        user_loop_after_forward(accelerator, model, opt, sched, torch.nn.functional.mse_loss(model(x + noise, t), noise))


def user_loop_after_forward(accelerator: Accelerator, model, opt, sched, loss: torch.Tensor) -> None:
    """The rest of :func:`user_loop_step` once the loss is computed (under DeepSpeed ``accelerator.backward`` takes
    the engine's step itself and ``opt.step``/``opt.zero_grad`` are Accelerate's no-ops)."""
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def forward_hook_switch(model: torch.nn.Module):
    """``switch(on)``: the model's forward pre-hooks as they are now (the attached guard's) put back (``True``) or
    taken off (``False``), so that one model serves the plain and the attached variants."""
    hook_dicts = [model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs]
    attached_hooks = [dict(d) for d in hook_dicts]

    def switch(on: bool) -> None:
        for d, saved in zip(hook_dicts, attached_hooks):
            d.clear()
            if on:
                d.update(saved)
    return switch


def bootstrap_median_ci(diffs: list[float], resamples: int = 400, seed: int = 1) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``diffs`` (the paired differences of one variant)."""
    rng = random.Random(seed)
    n = len(diffs)
    meds = sorted(statistics.median(rng.choices(diffs, k=n)) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def check_gradients(model, max_norm=1e4):
    """The seed article's check: one ``.item()`` per parameter."""
    total_norm = 0.0
    for p in model.parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            total_norm += param_norm.item() ** 2
    total_norm = total_norm ** 0.5
    if not torch.isfinite(torch.tensor(total_norm)):
        return False, total_norm
    return True, total_norm


def measure(kind: str, args, run_dir: str) -> dict:
    factory, shape, description = build(kind, args.quick, args.dit_frames)
    # ONE model, optimizer, scheduler and Accelerator for all variants: separate copies differ by as much as the guard.
    accelerator = Accelerator(cpu=args.device == "cpu")
    model, opt, sched = prepared_training(accelerator, factory)
    # The explicit guard is built first and not wrapped: it holds the original methods.
    explicit = vidstab.Guard(accelerator, model, opt, sched, run_dir=os.path.join(run_dir, f"{kind}-explicit"))
    attached = vidstab.attach(accelerator, model, opt, sched, run_dir=os.path.join(run_dir, f"{kind}-attached"))
    # The other variants call what the user's loop calls without vidstab: the originals attach wrapped ...
    backward, clip = attached.original_backward, attached.original_clip
    optimizer_step, scheduler_step = attached.control.optimizer_step, attached.control.scheduler_step
    # ... on a model without the attached guard's forward pre-hook (put back, outside the timing, for its steps).
    hooks = forward_hook_switch(model)

    guards = {"attached": attached, "explicit": explicit}
    dev = accelerator.device
    batches = fixed_batches(shape, dev)

    def prepare_step(name: str) -> None:
        """Outside the timing: the attached guard's hook present only for its own steps."""
        hooks(name == "attached")

    def one_step(name: str, i: int) -> None:
        x, noise, t = batches[i % len(batches)]
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
            if name == "explicit":
                explicit.backward(loss, batch={"latents": x, "noise": noise, "timesteps": t})
                explicit.step(max_grad_norm=1.0)
                return
            if name == "attached":  # the user's own loop, wrapped by vidstab.attach
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                return
            if name == "seed" and not torch.isfinite(loss):
                opt.zero_grad(set_to_none=True)
                return
            backward(loss)
            if name == "seed":
                finite, _ = check_gradients(model)
                if not finite:
                    opt.zero_grad(set_to_none=True)
                    return
            clip(model.parameters(), 1.0)
            optimizer_step()
            scheduler_step()
            opt.zero_grad(set_to_none=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for name in VARIANTS:
        prepare_step(name)
        for i in range(args.warmup):
            one_step(name, i)
    reads = {}
    for name in VARIANTS:
        counter = {"n": 0}
        prepare_step(name)
        with count_reads(counter):
            for i in range(4):
                one_step(name, i)
        reads[name] = counter["n"] / 4
    # Size the run to about args.seconds per model (args.dit_seconds for the DiT: fewer, longer rounds).
    sync()
    prepare_step("plain")
    t0 = time.perf_counter()
    one_step("plain", 0)
    sync()
    plain_s = time.perf_counter() - t0
    seconds = args.dit_seconds if kind == "dit" else args.seconds
    rounds = max(args.min_rounds, min(args.max_rounds, int(seconds / (len(VARIANTS) * max(plain_s, 1e-4)))))
    times = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}  # this thread's CPU time: what load from other processes inflates least
    shuffler = random.Random(0)
    started = time.perf_counter()
    for r in range(rounds):
        # A fresh random order each round: with a rotation, each variant would always inherit the same warm caches.
        order = shuffler.sample(VARIANTS, len(VARIANTS))
        for name in order:
            prepare_step(name)
            sync()
            c0, t0 = time.thread_time(), time.perf_counter()
            one_step(name, r)
            sync()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    elapsed = time.perf_counter() - started
    hooks(True)
    for guard in guards.values():
        guard.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    paired = {k: [a - b for a, b in zip(times[k], times["plain"])] for k in VARIANTS}
    added = {k: statistics.median(d) * 1e3 for k, d in paired.items()}
    added_ci = {k: [round(x * 1e3, 3) for x in bootstrap_median_ci(paired[k])] for k in VARIANTS[1:]}
    added_cpu = {k: statistics.median(a - b for a, b in zip(cpu[k], cpu["plain"])) * 1e3 for k in VARIANTS}
    # The mean as well: work done once every n steps (the event log encodes its buffered metrics lines at a
    # flush, every 100 steps or 1 s) is outside the median but is still paid, n times rarer.
    added_cpu_mean = {k: statistics.fmean(a - b for a, b in zip(cpu[k], cpu["plain"])) * 1e3 for k in VARIANTS}
    findings = sum(1 for name in ("attached", "explicit")
                   for e in vidstab.read_events(os.path.join(run_dir, f"{kind}-{name}"))
                   if e["kind"] in ("warn", "skip", "rollback_request", "incident"))
    params = sum(p.numel() for p in model.parameters())
    return {"model": description, "params": params, "param_tensors": len(list(model.parameters())),
            "rounds": rounds, "seconds": round(elapsed, 1), "median_step_ms": med, "added_ms": added,
            "added_cpu_ms": added_cpu, "added_cpu_mean_ms": added_cpu_mean,
            "added_ms_ci95": added_ci,
            # The paired ratio is what the DiT's gate reads: the paired difference cancels the drift between rounds.
            "paired_ratio": {k: 1.0 + added[k] / med["plain"] for k in VARIANTS},
            "ratio": {k: med[k] / med["plain"] for k in VARIANTS}, "host_reads_per_step": reads,
            "findings_on_healthy_steps": findings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default="mlp,transformer,dit", help="comma-separated: mlp, transformer, dit")
    ap.add_argument("--seconds", type=float, default=60.0, help="timed seconds per small model (all variants)")
    ap.add_argument("--dit_seconds", type=float, default=240.0, help="timed seconds of the DiT (all variants)")
    ap.add_argument("--min_rounds", type=int, default=40)
    ap.add_argument("--max_rounds", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=5, help="steps per variant before timing")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a few seconds per model")
    ap.add_argument("--dit_frames", type=int, default=8,
                    help="latent frames of the DiT (8: about 90 ms a step here; 4: about 40 ms; module docstring)")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.dit_seconds, args.min_rounds, args.warmup = 2.0, 2.0, 5, 2
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    run_dir = tempfile.mkdtemp(prefix="vidstab-bench-")
    results = {kind: measure(kind, args, run_dir) for kind in args.models.split(",")}
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    print(f"device {args.device}, {args.threads} thread(s); load average {load:.1f} before, {load_after:.1f} after")
    print("+ms = median over rounds of (variant step - plain step in the same round), wall clock [thread CPU time];"
          " x = 1 + that / plain median (paired ratio); mean = mean of the thread-CPU differences (rare work included).")
    print(f"{'model':<14}{'plain ms':>10}" + "".join(f"{v + ' +ms [cpu]':>24}{'x':>7}" for v in VARIANTS[1:])
          + f"{'reads/step (plain, attached, explicit, seed)':>48}")
    for kind, r in results.items():
        line = f"{kind:<14}{r['median_step_ms']['plain']:>10.2f}"
        for v in VARIANTS[1:]:
            line += f"{r['added_ms'][v]:>+15.3f} [{r['added_cpu_ms'][v]:+.3f}]{r['paired_ratio'][v]:>7.3f}"
        reads = r["host_reads_per_step"]
        line += f"{reads['plain']:>18.1f}{reads['attached']:>10.1f}{reads['explicit']:>10.1f}{reads['seed']:>10.1f}"
        print(line)
    for kind, r in results.items():
        print(f"  {kind}: {r['model']}, {r['params'] / 1e6:.2f}M params in {r['param_tensors']} tensors, "
              f"{r['rounds']} rounds in {r['seconds']}s, findings on healthy steps: {r['findings_on_healthy_steps']}; "
              "mean thread-CPU +ms: " + ", ".join(f"{v} {r['added_cpu_mean_ms'][v]:+.3f}" for v in VARIANTS[1:])
              + "; 95% interval of +ms: " + ", ".join(f"{v} [{lo:+.3f}, {hi:+.3f}]" for v, (lo, hi) in r["added_ms_ci95"].items())
              + "; ratio of medians: " + ", ".join(f"{v} {r['ratio'][v]:.3f}" for v in VARIANTS[1:]))
    small = [k for k in ("mlp", "transformer") if k in results]
    worst_small = max((results[k]["added_ms"][v] for k in small for v in ("attached", "explicit")), default=None)
    worst_small_cpu = max((results[k]["added_cpu_ms"][v] for k in small for v in ("attached", "explicit")), default=None)
    worst_small_cpu_mean = max((results[k]["added_cpu_mean_ms"][v] for k in small for v in ("attached", "explicit")),
                               default=None)
    dit_ratio = max((results["dit"]["paired_ratio"][v] for v in ("attached", "explicit")), default=None) if "dit" in results else None
    dit_ratio_of_medians = (max(results["dit"]["ratio"][v] for v in ("attached", "explicit"))
                            if "dit" in results else None)
    summary = {
        "benchmark": "guard_overhead", "device": args.device, "load_average": [round(load, 2), round(load_after, 2)],
        "models": {k: {"model": r["model"], "params": r["params"], "rounds": r["rounds"],
                       "median_step_ms": {v: round(x, 3) for v, x in r["median_step_ms"].items()},
                       "added_ms": {v: round(x, 3) for v, x in r["added_ms"].items()},
                       "added_cpu_ms": {v: round(x, 3) for v, x in r["added_cpu_ms"].items()},
                       "added_cpu_mean_ms": {v: round(x, 3) for v, x in r["added_cpu_mean_ms"].items()},
                       "added_ms_ci95": r["added_ms_ci95"],
                       "paired_ratio": {v: round(x, 4) for v, x in r["paired_ratio"].items()},
                       "ratio": {v: round(x, 4) for v, x in r["ratio"].items()},
                       "host_reads_per_step": r["host_reads_per_step"],
                       "findings_on_healthy_steps": r["findings_on_healthy_steps"]} for k, r in results.items()},
        "worst_added_ms_small": None if worst_small is None else round(worst_small, 3),
        "worst_added_cpu_ms_small": None if worst_small_cpu is None else round(worst_small_cpu, 3),
        "worst_added_cpu_mean_ms_small": None if worst_small_cpu_mean is None else round(worst_small_cpu_mean, 3),
        "target_ratio_dit": 1.01, "worst_ratio_dit": None if dit_ratio is None else round(dit_ratio, 4),
        "worst_ratio_of_medians_dit": None if dit_ratio_of_medians is None else round(dit_ratio_of_medians, 4),
        "meets_target": None if dit_ratio is None else bool(dit_ratio <= 1.01),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
