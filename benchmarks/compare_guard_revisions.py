"""The attached guard of a git revision against the working tree's, paired per round in one process.

A change to the guard's hot path is worth a few microseconds per step; two runs of ``bench_guard_overhead.py``
differ by more than that. Here both versions guard ONE model, optimizer and scheduler of
``bench_guard_overhead.py``'s size classes in the same process: the revision's ``vidstab`` package (``git archive``)
and the working tree's are copied to a temporary folder and imported as ``vidstab_base`` and ``vidstab_new``.
Five variants: ``base`` and ``base_again`` (two guards of the revision), ``new`` and ``new_again`` (two of the
working tree) and ``plain`` (no guard). Each package guards two of the five steps of a round: with one guard
of the working tree against two of the revision, identical code measured 30-40 us per step slower in the package
with one guard (2026-12-03; its code is warm less often), so the working tree is read as its two guards against
the revision's two. One user loop (``accelerator.backward``, ``clip_grad_norm_``,
``optimizer.step``, ``lr_scheduler.step``); before each step the variant's guard is attached (the others'
patches undone, outside the timing). Each round runs one step of each in a random order.

Two figures per variant, medians of the per-round differences to ``base`` (and, last line, the guard's own
time as a mean, which holds work done once every n steps), and a third per guard, the time from its host read to
the optimizer step it then makes (on a GPU the device has nothing queued meanwhile): this thread's CPU time of the whole
step (what the user pays, noisy: the step itself varies), and the guard's own time (``perf_counter`` inside its
wrappers minus the original calls they make: the guard's code only, much steadier; each wrapper's timer adds
the same to every guard). Last line: one JSON object.

    python benchmarks/compare_guard_revisions.py                          # HEAD vs working tree, transformer
    python benchmarks/compare_guard_revisions.py --rev HEAD~3 --model mlp --rounds 3000
    python benchmarks/compare_guard_revisions.py --judged      # every step judged (runs of several processes)
    python benchmarks/compare_guard_revisions.py --explicit    # guard.backward(loss, batch=...) + guard.step
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_guard_overhead as bench  # noqa: E402  (same models, same batches)

import vidstab  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("base", "base_again", "new", "new_again", "plain")
WRAPPERS = ("_user_backward", "_user_clip_grad_norm", "_user_optimizer_step", "_user_scheduler_step", "_see_model_inputs")
#: ``--explicit``: the guard's own calls (``guard.step`` also zeroes the gradients, as the plain loop does itself)
EXPLICIT_CALLS = ("backward", "step")
ORIGINALS = ("_backward", "_clip", "_optimizer_step", "_scheduler_step")


def import_copy(source: Path, name: str, into: Path):
    """The ``vidstab`` package folder ``source``, copied to ``into / name`` and imported as the package ``name``."""
    package = into / name
    shutil.copytree(source, package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in package.rglob("*.py"):  # the few absolute imports inside the package
        text = path.read_text(encoding="utf-8")
        if "vidstab." in text:
            path.write_text(text.replace("from vidstab.", f"from {name}."), encoding="utf-8")
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


def import_revision(rev: str, into: Path):
    """``vidstab`` as it is at ``rev``, and as it is in the working tree, imported the same way, as the packages
    ``vidstab_base`` and ``vidstab_new`` from copies under ``into``. Both copies, not the working tree's own
    ``vidstab`` beside a copy: the guard of the package imported first and from the repository measured
    30-40 us per step slower than the same code copied and imported later (2026-12-03, identical trees)."""
    archive = into / "base.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), rev, "vidstab"], check=True)
    extracted = into / "extracted"
    extracted.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(extracted, filter="data")
    return import_copy(extracted / "vidstab", "vidstab_base", into), import_copy(REPO / "vidstab", "vidstab_new", into)


def own_time(guard, clock: list[int], wrappers: tuple[str, ...] = WRAPPERS) -> None:
    """Charge ``guard``'s ``wrappers`` (+) and the originals they call (-) to ``clock[0]``."""
    def timed(fn, sign):
        def call(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                clock[0] += sign * (time.perf_counter_ns() - t0)
        return call

    for name in ORIGINALS:
        setattr(guard, name, timed(getattr(guard, name), -1))
    for name in wrappers:
        setattr(guard, name, timed(getattr(guard, name), +1))


def time_read_to_step(packages, guards, window: list[int]) -> None:
    """Add to ``window[0]`` the time from the end of each guard's host read (``signals.gather_and_read``) to
    the start of the optimizer step it then makes: what runs while, on a GPU, the device waits for the step
    (issue 16, point 4)."""
    read_at = [None]
    for pkg in packages:
        read = pkg.signals.gather_and_read

        def marked(*a, _read=read, **k):
            try:
                return _read(*a, **k)
            finally:
                read_at[0] = time.perf_counter_ns()
        pkg.signals.gather_and_read = marked
    for guard in guards:
        step = guard._optimizer_step

        def call(*a, _step=step, **k):
            if read_at[0] is not None:
                window[0] += time.perf_counter_ns() - read_at[0]
                read_at[0] = None
            return _step(*a, **k)
        guard._optimizer_step = call


def unwrap(guard) -> None:
    """``guard.detach()`` without its event-log flush (which would move the flushes out of the timed steps)."""
    flush = guard.events.flush
    guard.events.flush = lambda: None
    try:
        guard.detach()
    finally:
        guard.events.flush = flush


def interval(diffs: list[float], resamples: int = 400) -> list[float]:
    return [round(x, 1) for x in bench.bootstrap_median_ci(diffs, resamples)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="git revision of the baseline guard")
    ap.add_argument("--model", default="transformer", choices=["mlp", "transformer", "dit"])
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=50, help="steps per variant before timing")
    ap.add_argument("--judged", action="store_true",
                    help="every step judged on its own, no batched healthy steps (what a run of several processes takes)")
    ap.add_argument("--explicit", action="store_true",
                    help="the explicit calls of bench_guard_overhead.py's 'explicit' variant instead of the attached loop")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="vidstab-revisions-"))
    base_pkg, new_pkg = import_revision(args.rev, tmp)
    factory, shape, description = bench.build(args.model, quick=False)
    accelerator = Accelerator(cpu=True)
    model, opt, sched = bench.prepared_training(accelerator, factory)
    clock = [0]
    guards = {}
    for name, pkg in (("base", base_pkg), ("base_again", base_pkg), ("new", new_pkg), ("new_again", new_pkg)):
        if args.explicit:
            guards[name] = pkg.Guard(accelerator, model, opt, sched, run_dir=tmp / name)
        else:
            guards[name] = pkg.attach(accelerator, model, opt, sched, run_dir=tmp / name)
            unwrap(guards[name])
        if args.judged:
            guards[name]._batchable = False
        own_time(guards[name], clock, EXPLICIT_CALLS if args.explicit else WRAPPERS)
    window = [0]
    time_read_to_step((base_pkg, new_pkg), list(guards.values()), window)
    guards["plain"] = None
    attached = [None]

    def use(name: str) -> None:
        if args.explicit:
            attached[0] = name
            return
        if attached[0] is not None:
            unwrap(guards[attached[0]])
        attached[0] = None
        if guards[name] is not None:
            guards[name].wrap()
            attached[0] = name

    batches = bench.fixed_batches(shape)

    def one_step(i: int) -> None:
        guard = guards[attached[0]] if args.explicit else None
        if guard is None:
            bench.user_loop_step(accelerator, model, opt, sched, batches[i % len(batches)])
            return
        x, noise, t = batches[i % len(batches)]
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
            guard.backward(loss, batch={"latents": x, "noise": noise, "timesteps": t})
            guard.step(max_grad_norm=1.0)

    for i in range(args.warmup):
        for name in VARIANTS:
            use(name)
            one_step(i)
    cpu = {name: [] for name in VARIANTS}
    own = {name: [] for name in VARIANTS}
    gap = {name: [] for name in VARIANTS}
    shuffler = random.Random(0)
    for r in range(args.rounds):
        for name in shuffler.sample(VARIANTS, len(VARIANTS)):
            use(name)
            clock[0] = window[0] = 0
            c0 = time.thread_time_ns()
            one_step(r)
            cpu[name].append((time.thread_time_ns() - c0) / 1e3)
            own[name].append(clock[0] / 1e3)
            gap[name].append(window[0] / 1e3)
    use("plain")
    for guard in guards.values():
        if guard is not None:
            guard.close()
    step_us = {k: [a - b for a, b in zip(cpu[k], cpu["base"])] for k in VARIANTS}
    own_us = {k: [a - b for a, b in zip(own[k], own["base"])] for k in VARIANTS if k != "plain"}
    out = {
        "benchmark": "compare_guard_revisions", "rev": args.rev, "model": description, "rounds": args.rounds,
        "judged": args.judged, "explicit": args.explicit,
        "plain_step_ms": round(statistics.median(cpu["plain"]) / 1e3, 3),
        "added_vs_plain_us": {k: round(statistics.median(a - b for a, b in zip(cpu[k], cpu["plain"])), 1)
                              for k in ("base", "new")},
        "step_us_vs_base": {k: round(statistics.median(d), 1) for k, d in step_us.items()},
        "step_us_vs_base_ci95": {k: interval(d) for k, d in step_us.items() if k != "base"},
        "own_us": {k: round(statistics.median(own[k]), 1) for k in own_us},
        "own_us_vs_base": {k: round(statistics.median(d), 1) for k, d in own_us.items()},
        "own_us_vs_base_ci95": {k: interval(d) for k, d in own_us.items() if k != "base"},
        # Means hold what a median leaves out: work done once every n steps (the event log's flush, a batch).
        "own_us_mean": {k: round(statistics.fmean(own[k]), 1) for k in own_us},
        "own_us_vs_base_mean": {k: round(statistics.fmean(d), 1) for k, d in own_us.items()},
        # From the host read to the optimizer step: on a GPU the device has nothing queued meanwhile.
        "read_to_step_us": {k: round(statistics.median(gap[k]), 1) for k in own_us},
        "read_to_step_us_mean": {k: round(statistics.fmean(gap[k]), 1) for k in own_us},
    }
    print(f"{description}, {'explicit calls' if args.explicit else 'attached loop'}, {args.rounds} rounds, baseline {args.rev}; plain step {out['plain_step_ms']:.3f} ms (thread CPU)")
    print(f"{'variant':<12}{'step us vs base':>18}{'95% interval':>20}{'own us':>10}{'own vs base':>13}{'95% interval':>20}")
    for k in VARIANTS:
        ci = out["step_us_vs_base_ci95"].get(k, [0.0, 0.0])
        line = f"{k:<12}{out['step_us_vs_base'][k]:>+18.1f}{str(ci):>20}"
        if k in own_us:
            line += f"{out['own_us'][k]:>10.1f}{out['own_us_vs_base'][k]:>+13.1f}{str(out['own_us_vs_base_ci95'].get(k, [0.0, 0.0])):>20}"
        print(line)
    mean = out["own_us_vs_base_mean"]
    med = out["own_us_vs_base"]
    out["own_us_new_vs_base"] = round((med["new"] + med["new_again"] - med["base_again"]) / 2, 1)
    out["own_us_new_vs_base_mean"] = round((mean["new"] + mean["new_again"] - mean["base_again"]) / 2, 1)
    print(f"the working tree's guard: {out['own_us_new_vs_base']:+.1f} us of own time per step against {args.rev} (its two "
          f"guards against the revision's two; mean over steps, rare work included: {out['own_us_new_vs_base_mean']:+.1f} us)")
    gap_med, gap_mean = out["read_to_step_us"], out["read_to_step_us_mean"]
    print("from the host read to the optimizer step (median / mean us): "
          + ", ".join(f"{k} {gap_med[k]:.1f} / {gap_mean[k]:.1f}" for k in own_us))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
