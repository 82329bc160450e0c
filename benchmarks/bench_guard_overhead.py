"""Claim: vidstab's guard costs (almost) nothing per step; the usual per-parameter check does not.

Three variants of the same Accelerate training step on a small video DiT (the reference ``VideoDiT``):

* ``plain``   - ``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step``, ``scheduler.step``, ``zero_grad``;
* ``vidstab`` - the same step through ``guard.backward`` + ``guard.step`` (default GuardConfig, events on disk);
* ``seed``    - the widespread baseline: ``if not torch.isfinite(loss)`` and ``check_gradients`` summing
  ``p.grad.norm().item() ** 2`` per parameter (one host sync per parameter), then the plain step.

The variants are interleaved (round-robin blocks of steps) so drift and other load hit all of them alike;
the median step time of each after warm-up is reported with the ratio to ``plain``, and the number of
device->host reads per optimizer step (``Tensor.item/tolist/__bool__/__float__/__int__/cpu/numpy`` calls,
counted by wrapping those methods) for all three. The last line of output is one JSON object.

    python benchmarks/bench_guard_overhead.py                 # CPU, ~1 minute (under 2 on a loaded machine)
    python benchmarks/bench_guard_overhead.py --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time

import torch
from accelerate import Accelerator

import vidstab

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@contextlib.contextmanager
def count_reads(counter: dict):
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


def build_model(args):
    try:
        from vidstab.reference.model import VideoDiT

        return VideoDiT(in_channels=4, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                        patch_size=(1, 2, 2)), "vidstab.reference.model.VideoDiT"
    except ImportError:  # stand-in transformer when the reference is not available
        class StandIn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Conv3d(4, args.hidden, (1, 2, 2), (1, 2, 2))
                layer = torch.nn.TransformerEncoderLayer(args.hidden, 4, 4 * args.hidden, batch_first=True)
                self.blocks = torch.nn.TransformerEncoder(layer, args.layers)
                self.out = torch.nn.Linear(args.hidden, 16)

            def forward(self, x, t):
                h = self.embed(x).flatten(2).transpose(1, 2)
                return self.out(self.blocks(h))

        return StandIn(), "stand-in transformer"


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


def bookkeeping_ms(accelerator, guard, batch, n: int = 200) -> float:
    """The guard's own work per optimizer step with one micro-batch, without the shared backward/clip/step:
    recording the micro-step, packing, the gather + host read, the detectors and the event log."""
    from vidstab import signals
    from vidstab.detectors import absorb, judge

    x, noise, t = batch
    loss = torch.ones((), device=x.device)
    norm = torch.ones((), device=x.device)

    def once():
        guard.window.record(loss, {"latents": x, "noise": noise, "timesteps": t}, None, t, False)
        row = guard.window.pack(norm, False, None, None, None)
        table, micro = signals.gather_and_read(accelerator, row, guard.window.micro_rows())
        stats = guard._build_stats(guard.step_count, table, 1.0, True)
        judge(guard.detectors, stats)
        stats.applied = True
        absorb(guard.detectors, stats)
        guard._report(stats, table, micro, stop=False)
        guard.window.reset()

    once()
    t0 = time.perf_counter()
    for _ in range(n):
        once()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200, help="rounds of one step per variant (rotating order)")
    ap.add_argument("--warmup", type=int, default=5, help="steps per variant before timing")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    accelerator = Accelerator(cpu=args.device == "cpu")
    dev = accelerator.device
    torch.manual_seed(0)
    variants = {}
    model_name = ""
    run_dir = tempfile.mkdtemp(prefix="vidstab-bench-")
    for name in ("plain", "vidstab", "seed"):
        torch.manual_seed(0)
        model, model_name = build_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        guard = vidstab.attach(accelerator, model, opt, sched, run_dir=run_dir) if name == "vidstab" else None
        variants[name] = (model, opt, sched, guard)
    n_params = sum(p.numel() for p in variants["plain"][0].parameters())
    n_tensors = len(list(variants["plain"][0].parameters()))

    g = torch.Generator().manual_seed(0)
    shape = (args.batch, 4, args.frames, args.size, args.size)
    batches = [(torch.randn(shape, generator=g).to(dev), torch.randn(shape, generator=g).to(dev),
                torch.randint(0, 1000, (args.batch,), generator=g).to(dev)) for _ in range(8)]

    def one_step(name: str, i: int) -> None:
        model, opt, sched, guard = variants[name]
        x, noise, t = batches[i % len(batches)]
        with accelerator.accumulate(model):
            pred = model(x + noise, t)
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float()) if pred.shape == noise.shape else pred.float().square().mean()
            if name == "vidstab":
                guard.backward(loss, batch={"latents": x, "noise": noise, "timesteps": t}, sample_ids=None)
                guard.step(max_grad_norm=1.0)
                return
            if name == "seed" and not torch.isfinite(loss):
                opt.zero_grad(set_to_none=True)
                return
            accelerator.backward(loss)
            if name == "seed":
                finite, _ = check_gradients(model)
                if not finite:
                    opt.zero_grad(set_to_none=True)
                    return
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # Warm-up, then host reads per optimizer step (a few counted steps per variant).
    for name in variants:
        for i in range(args.warmup):
            one_step(name, i)
    reads = {}
    for name in variants:
        counter = {"n": 0}
        with count_reads(counter):
            for i in range(4):
                one_step(name, i)
        reads[name] = counter["n"] / 4

    # Interleaved timing.
    times = {name: [] for name in variants}
    started = time.perf_counter()
    names = list(variants)
    for r in range(args.rounds):
        # One step of each variant per round, in rotating order: neighbours in time share the machine's mood.
        for name in names[r % len(names):] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            one_step(name, r)
            sync()
            times[name].append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    # Paired per-round differences are steadier than a ratio of medians on a loaded machine.
    paired = {k: statistics.median(a - b for a, b in zip(times[k], times["plain"])) * 1e3 for k in times}
    events = vidstab.read_events(run_dir)
    verdicts = {k: sum(1 for e in events if e["kind"] == k) for k in ("warn", "skip", "rollback", "incident")}
    book = bookkeeping_ms(accelerator, variants["vidstab"][3], batches[0])
    ratio = {k: med[k] / med["plain"] for k in med}
    print(f"model: {model_name}, {n_params / 1e6:.2f}M params in {n_tensors} tensors; latents {list(shape)}; "
          f"device {dev}; {args.rounds} interleaved steps per variant ({elapsed:.0f}s)")
    print("host reads/step counts every read in the step, the optimizer's own included (AdamW reads its CPU step "
          "counters); 'added' is what the check adds on top of the plain loop.")
    print(f"{'variant':<10}{'median step ms':>16}{'vs plain':>10}{'host reads/step':>17}{'added':>8}")
    for k in variants:
        print(f"{k:<10}{med[k]:>16.2f}{ratio[k]:>10.3f}{reads[k]:>17.1f}{reads[k] - reads['plain']:>8.1f}"
              f"   paired diff {paired[k]:+.2f} ms")
    print(f"vidstab findings during the benchmark (should be none on healthy steps): {verdicts}")
    print(f"guard bookkeeping alone (record + pack + gather/read + detectors + events), measured in isolation: "
          f"{book:.3f} ms per optimizer step = {book / med['plain']:.2%} of a plain step")
    print(json.dumps({
        "benchmark": "guard_overhead", "device": str(dev), "model": model_name, "params": n_params,
        "param_tensors": n_tensors, "median_step_ms": {k: round(v, 3) for k, v in med.items()},
        "ratio_vs_plain": {k: round(v, 4) for k, v in ratio.items()},
        "paired_diff_ms": {k: round(v, 3) for k, v in paired.items()},
        "guard_bookkeeping_ms": round(book, 4), "guard_bookkeeping_fraction": round(book / med["plain"], 5),
        "host_reads_per_step": reads, "added_host_reads_per_step": {k: reads[k] - reads["plain"] for k in reads},
        "target_ratio_vidstab": 1.02, "meets_target": ratio["vidstab"] <= 1.02,
        "vidstab_events": verdicts, "steps_timed_per_variant": len(times["plain"]), "seconds": round(elapsed, 1),
    }))


if __name__ == "__main__":
    main()
