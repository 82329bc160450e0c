"""Claim: vidstab's own memory and host time are small and flat: extra peak <= 0.1x the weights' bytes, and the
guard's host time per step at 5,000 parameter tensors <= 1.3x that at 50.

Two parts, each side by side with today's update measurement (``FullCopyProbe`` below: a full copy of every
trainable tensor before a measured step, the code path the sampled :class:`vidstab.guard.param_probe.ParamProbe`
replaced; kept here only as the baseline):

* **Extra peak memory** on a step that measures the weights and the update (every ``param_norm_every`` steps),
  for the reference video DiT and a diffusers ``UNet2DConditionModel`` on one small latent (activations small
  beside the weights, as with gradient checkpointing or a large model: the optimizer step is then the peak,
  where a copy of the weights adds the most; a step whose activations dominate hides any copy): the same Accelerate step (AdamW, clip
  1.0) plain, guarded (``guard.backward`` + ``guard.step``) and guarded with the full copy. What is measured, on a
  CPU: the peak of the bytes held by tensors during the step, from PyTorch's profiler memory accounting
  (``profile_memory=True`` and its memory timeline: every allocation and free of a tensor's storage, not the
  process's resident memory); on CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated``. vidstab's extra
  peak is the guarded step's peak minus the plain step's, over the bytes of the trainable weights.
* **Host time per step** of the guard on a model of 50, 500 and 5,000 parameter tensors holding the same number
  of elements: the time of ``guard.backward`` + ``guard.step`` less the calls they make for the user (backward,
  clip, optimizer and scheduler steps, ``zero_grad``: timed around each call), i.e. the guard's own work, this
  thread's CPU time with one intra-op thread (a CPU step is all host time; the load of other processes inflates
  it least; on CUDA the wall time, each user call ending with the device's work it queued, so the guard's own
  host read waits for its own work only); the mean over each ``param_norm_every`` cycle (the measured step is in
  it), median over the cycles.
  The C allocator's deferred work on the blocks a call freed is done at the end of that call (:func:`settle_allocator`):
  else the blocks the user's backward frees per parameter tensor are sorted in the guard's next allocation.
  The ratio 5,000 vs 50 says whether the guard's per-step work grows with the number of tensors; beside it the
  same ratio of a guard that never measures the weights (``param_norm_every=0``: no work per tensor at all).
  The same ratio against 50 tensors **with the caches evicted** after every user call (a pass over
  ``EVICT_BYTES``, billed to the user) holds the cache state equal: after a 5,000-tensor user step (about 200 ms
  of AdamW over 20,000 tensors) the guard's unchanged work runs on cold caches, at 50 tensors (about 5 ms) on warm
  ones; the difference is what the guard itself adds per tensor.
* **The small UNet step** (the issue's many-small-tensors case): ``1 +`` the guard's own host time over the plain
  step's (backward, clip, optimizer and scheduler steps, ``zero_grad``; the forward is left out of both), measured
  as above.

    python benchmarks/bench_guard_memory.py           # CPU, a few minutes
    python benchmarks/bench_guard_memory.py --quick   # fewer cycles, smaller models
    python benchmarks/bench_guard_memory.py --smoke   # seconds: every part runs (the memory on the DiT only), the
                                                      # figures mean nothing (benchmarks/gpu_check.sh --dry-run)
    python benchmarks/bench_guard_memory.py --device cuda   # on a GPU (benchmarks/gpu_check.sh)

Last line: one JSON object (``extra_peak_over_param_bytes``: the larger of the two models';
``host_time_ratio_5000_vs_50``; ``host_time_ratio_5000_vs_50_caches_evicted``;
``host_time_ratio_5000_vs_50_unmeasured``; the same for the full copy under ``baseline``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vidstab  # noqa: E402
from vidstab.guard.param_probe import ParamProbe  # noqa: E402
from vidstab.signals import local_tensor, sum_of_squares  # noqa: E402

PARAM_NORM_EVERY = vidstab.GuardConfig().param_norm_every


class FullCopyProbe(ParamProbe):
    """The baseline: a copy of every local trainable tensor before the step, the exact update after it."""

    @torch.no_grad()
    def snapshot(self):
        return [local_tensor(p).detach().clone() for p in self.all_params if p.numel() > 0]

    @torch.no_grad()
    def sums(self, before):
        cur = [local_tensor(p).detach() for p in self.all_params if p.numel() > 0]
        if before is not None:
            torch._foreach_sub_(before, cur)
        return sum_of_squares(cur), (sum_of_squares(before) if before is not None else None)


# ------------------------------------------------------------------------------------------------ models
def dit(quick: bool, device: str):
    from vidstab.reference.model import VideoDiT

    model = VideoDiT(in_channels=4, hidden_size=96, num_layers=2 if quick else 4, num_heads=4, patch_size=(1, 2, 2))
    x = torch.randn(1, 4, 2, 8, 8, device=device)  # activations small beside the weights: the optimizer step peaks
    t = torch.randint(0, 1000, (1,), device=device)
    return model, lambda m: torch.nn.functional.mse_loss(m(x, t), x), {"latents": x, "timesteps": t}


def unet(quick: bool, device: str):
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    x, text, t = (torch.randn(1, 4, 8, 8, device=device), torch.randn(1, 6, 32, device=device),
                  torch.randint(0, 1000, (1,), device=device))
    return model, lambda m: torch.nn.functional.mse_loss(m(x, t, text).sample, x), {"latents": x, "text": text}


class ManyTensors(torch.nn.Module):
    """``n`` parameter tensors of ``elements // n`` each: the same work, split in more or fewer tensors."""

    def __init__(self, n: int, elements: int) -> None:
        super().__init__()
        self.parts = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(elements // n) * 0.02) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cat(list(self.parts))


# ------------------------------------------------------------------------------------------------ steps
class Variants:
    """One prepared model, optimizer and scheduler; a plain step and the guarded steps on them."""

    def __init__(self, model, loss_fn, batch, run_dir: str, device: str, unmeasured: bool = False) -> None:
        AcceleratorState._reset_state(True)
        self.accelerator = Accelerator(cpu=device == "cpu")
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        self.model, self.opt, self.sched = self.accelerator.prepare(model, opt, sched)
        self.loss_fn, self.batch = loss_fn, batch
        self.guards = {}
        for name, probe in (("guarded", None), ("full_copy", FullCopyProbe)):
            guard = vidstab.Guard(self.accelerator, self.model, self.opt, self.sched,
                                  run_dir=os.path.join(run_dir, name))
            if probe is not None:
                guard.control.probe = probe(guard.control.probe.all_params)
            self.guards[name] = guard
        if unmeasured:  # the guard with no per-tensor work at all: the weights and the update never measured
            self.guards["unmeasured"] = vidstab.Guard(self.accelerator, self.model, self.opt, self.sched,
                                                      run_dir=os.path.join(run_dir, "unmeasured"),
                                                      config=vidstab.GuardConfig(param_norm_every=0))
        self.guard_any = self.guards["guarded"]
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def step(self, name: str) -> None:
        with self.accelerator.accumulate(self.model):
            self.after_forward(name, self.loss_fn(self.model))

    def after_forward(self, name: str, loss: torch.Tensor) -> None:
        """The step after the user's forward: the plain calls, or the guard's."""
        if name == "plain":
            g = self.guard_any
            g.original_backward(loss)
            g.original_clip(self.model.parameters(), 1.0)
            g.control.optimizer_step()
            g.control.scheduler_step()
            self.opt.zero_grad(set_to_none=True)
            return
        guard = self.guards[name]
        guard.backward(loss, batch=self.batch)
        guard.step(1.0)

    def measured_next(self) -> None:
        """The next guarded step of every guard measures the weights and the update."""
        for guard in self.guards.values():
            guard.step_count = -(-guard.step_count // PARAM_NORM_EVERY) * PARAM_NORM_EVERY

    def close(self) -> None:
        for guard in self.guards.values():
            guard.close()


def peak_bytes(fn, device: str) -> int:
    """The peak of the bytes held by tensors while ``fn`` runs (see the module docstring)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(s) for s in sizes)


def memory_of(kind: str, args, run_dir: str) -> dict:
    model, loss_fn, batch = (dit if kind == "dit" else unet)(args.quick, args.device)
    v = Variants(model, loss_fn, batch, os.path.join(run_dir, kind), args.device)
    for _ in range(2):  # AdamW's state exists before anything is measured
        for name in ("plain", "guarded", "full_copy"):
            v.step(name)
    peaks = {}
    for name in ("plain", "guarded", "full_copy"):
        v.measured_next()
        peaks[name] = peak_bytes(lambda: v.step(name), args.device)
    v.close()
    out = {"params": sum(p.numel() for p in model.parameters()), "param_tensors": len(list(model.parameters())),
           "param_bytes": v.param_bytes, "peak_plain_bytes": peaks["plain"]}
    for name in ("guarded", "full_copy"):
        out[f"extra_peak_{name}_bytes"] = peaks[name] - peaks["plain"]
        out[f"extra_peak_{name}_over_param_bytes"] = round((peaks[name] - peaks["plain"]) / v.param_bytes, 4)
    return out


def settle_allocator() -> None:
    """Let the C allocator do now the work it defers on freed blocks: glibc sorts and merges the small blocks freed
    since its last request of 1 KiB or more at the next such requests (at most 10,000 blocks a request), whoever
    makes them. Without this, the blocks a user's backward frees per parameter tensor (its autograd bookkeeping) are
    merged in the guard's first allocations after it (in the plain step: in the clip), counted as the guard's time."""
    held = [bytearray(size) for size in range(4096, 6144, 256)]  # 8 requests, held so none reuses the last's block
    del held


def wait_for_device() -> None:
    """On CUDA, wait for the work queued so far (a no-op on a CPU): whoever queued it pays for it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(size[:-1]) * 1024 if size.endswith("K") else int(size)
    except (OSError, ValueError):
        return default


EVICT_BYTES = _last_level_cache_bytes()
"""A pass over the last-level cache's size: the caches about as cold as a large user step leaves them (measured
here: the guard at 50 tensors behind a real 5,000-tensor step in the user's calls is a little colder still)."""


class UserWork:
    """Times the calls a guarded step makes on the user's behalf (backward, clip, optimizer and scheduler steps,
    zero_grad): what is left of the guarded step is the guard's own host time. ``evict``: each call ends with a
    pass over ``EVICT_BYTES`` (the user's, timed with it)."""

    def __init__(self, evict: bool = False, clock=time.thread_time) -> None:
        self.cpu = 0.0
        self.clock = clock
        self.evict = torch.zeros(EVICT_BYTES // 4) if evict else None

    def timed(self, fn):
        def inner(*a, **k):
            settle_allocator()  # the blocks the caller freed are the caller's work
            c0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                if self.evict is not None:
                    self.evict.add_(1.0)
                wait_for_device()  # the device work this call queued is this call's, not the guard's next read
                settle_allocator()  # and those this call freed, this call's
                self.cpu += self.clock() - c0
        return inner

    def wrap(self, guards, opt) -> None:
        for guard in guards:
            guard.original_backward = self.timed(guard.original_backward)
            guard.original_clip = self.timed(guard.original_clip)
            guard.control.optimizer_step = self.timed(guard.control.optimizer_step)
            guard.control.scheduler_step = self.timed(guard.control.scheduler_step)
        opt.zero_grad = self.timed(opt.zero_grad)


def own_host_time(v: Variants, cycles: int, seed: int, evict: bool = False) -> dict:
    """The guard's own host time per step of each guarded variant (ms), and the plain step's (ms): variants
    interleaved in a random order, the mean over each ``param_norm_every`` cycle, the median over the cycles.
    ``evict``: every user call ends with the caches evicted (:class:`UserWork`)."""
    names = tuple(v.guards)
    for _ in range(3):
        for name in ("plain", *names):
            v.step(name)
    clock = time.thread_time if v.accelerator.device.type == "cpu" else time.perf_counter
    work = UserWork(evict, clock)
    work.wrap([v.guards[name] for name in names], v.opt)
    times = {name: [] for name in ("plain", *names)}
    rng = random.Random(seed)
    for _ in range(cycles * PARAM_NORM_EVERY):
        order = ["plain", *names]
        rng.shuffle(order)
        for name in order:
            with v.accelerator.accumulate(v.model):
                loss = v.loss_fn(v.model)  # the forward is the user's, outside the guard
                wait_for_device()
                settle_allocator()  # the blocks freed with the last step's graph (when ``loss`` was rebound) too
                work.cpu, c0 = 0.0, clock()
                v.after_forward(name, loss)
                wait_for_device()
                settle_allocator()  # the blocks the step freed last are its own work, not the next forward's
                spent = clock() - c0
                times[name].append(spent if name == "plain" else spent - work.cpu)
    v.close()
    out = {}
    for name, ts in times.items():
        per_cycle = [sum(ts[i:i + PARAM_NORM_EVERY]) / PARAM_NORM_EVERY for i in range(0, len(ts), PARAM_NORM_EVERY)]
        out[f"{name}_ms"] = round(1e3 * statistics.median(per_cycle), 3)
    return out


def host_time_of(n: int, args, run_dir: str, evict: bool = False) -> dict:
    elements = 500 if args.smoke else 50_000 if args.quick else 400_000
    model = ManyTensors(n, elements)
    x = torch.randn(elements, device=args.device)
    name = f"tensors{n}" + ("-evicted" if evict else "")
    v = Variants(model, lambda m: m(x).square().mean(), {"x": x}, os.path.join(run_dir, name), args.device,
                 unmeasured=True)
    return {"tensors": n, "elements": elements, "caches_evicted": evict, **own_host_time(v, args.cycles, n, evict)}


def unet_step_ratio(args, run_dir: str) -> dict:
    """The small diffusers UNet step: ``1 + the guard's own time / the plain step's`` (the user's forward and the
    calls made for the user in both), sampled against the full copy."""
    model, loss_fn, batch = unet(args.quick, args.device)
    v = Variants(model, loss_fn, batch, os.path.join(run_dir, "unet-time"), args.device)
    t = own_host_time(v, args.cycles, 0)
    return {**t, **{f"{name}_ratio": round(1 + t[f"{name}_ms"] / t["plain_ms"], 3) for name in ("guarded", "full_copy")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, few steps")
    parser.add_argument("--smoke", action="store_true", help="every part on tiny sizes, one cycle (CI: seconds)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cycles", type=int, default=None,
                        help=f"measured cycles of {PARAM_NORM_EVERY} steps per tensor count (default 12; --quick 2)")
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    args.cycles = args.cycles or (1 if args.smoke else 2 if args.quick else 12)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        # --smoke: the DiT only (the UNet's profile is the slow part; the UNet's step runs in the host-time part)
        memory = {kind: memory_of(kind, args, run_dir) for kind in (("dit",) if args.smoke else ("dit", "unet"))}
        for kind, m in memory.items():
            print(f"{kind:5s} {m['params']:>9,} params in {m['param_tensors']:>3} tensors ({m['param_bytes'] / 2**20:.2f} MiB); "
                  f"plain step peak {m['peak_plain_bytes'] / 2**20:.2f} MiB; vidstab's extra peak: sampled "
                  f"{m['extra_peak_guarded_bytes'] / 2**20:+.3f} MiB = {m['extra_peak_guarded_over_param_bytes']:.3f}x the "
                  f"weights, full copy (today's) {m['extra_peak_full_copy_bytes'] / 2**20:+.3f} MiB = "
                  f"{m['extra_peak_full_copy_over_param_bytes']:.3f}x", flush=True)
        counts = (5, 50, 500) if args.smoke else (50, 500, 5000)
        host = {n: host_time_of(n, args, run_dir) for n in counts}
        evicted = host_time_of(counts[0], args, run_dir, evict=True)
        for n, h in [*host.items(), (counts[0], evicted)]:
            print(f"{n:>5} tensors of {h['elements'] // n:,} elements{' (caches evicted)' if h['caches_evicted'] else ''}: "
                  f"the guard's own host time per step: sampled {h['guarded_ms']:.3f} ms, full copy (today's) "
                  f"{h['full_copy_ms']:.3f} ms, never measuring the weights {h['unmeasured_ms']:.3f} ms", flush=True)

        unet_time = unet_step_ratio(args, run_dir)
        print(f"unet step: plain {unet_time['plain_ms']:.2f} ms (backward, clip, optimizer), the guard's own "
              f"{unet_time['guarded_ms']:.3f} ms = {unet_time['guarded_ratio']:.3f}x, full copy (today's) "
              f"{unet_time['full_copy_ms']:.3f} ms = {unet_time['full_copy_ratio']:.3f}x", flush=True)

    def ratio(name: str, base: dict | None = None) -> float | None:
        return None if args.smoke else round(host[5000][f"{name}_ms"] / (base or host[50])[f"{name}_ms"], 3)

    result = {
        "extra_peak_over_param_bytes": max(m["extra_peak_guarded_over_param_bytes"] for m in memory.values()),
        "host_time_ratio_5000_vs_50": ratio("guarded"),
        "host_time_ratio_5000_vs_50_caches_evicted": ratio("guarded", evicted),
        "host_time_ratio_5000_vs_50_unmeasured": ratio("unmeasured"),
        "baseline": {"extra_peak_over_param_bytes": max(m["extra_peak_full_copy_over_param_bytes"]
                                                        for m in memory.values()),
                     "host_time_ratio_5000_vs_50": ratio("full_copy"),
                     "host_time_ratio_5000_vs_50_caches_evicted": ratio("full_copy", evicted),
                     "unet_step_ratio": unet_time["full_copy_ratio"]},
        "unet_step_ratio": unet_time["guarded_ratio"], "memory": memory, "host_time": [*host.values(), evicted],
        "unet_step": unet_time, "device": args.device, "quick": args.quick,
        "smoke": args.smoke,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
