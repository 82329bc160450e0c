#!/usr/bin/env python
"""The checks of ``benchmarks/gpu_check.sh`` that no other benchmark makes; each prints one JSON line.

    python benchmarks/gpu_check_pieces.py sync_debug     [--dry-run]  # the trainer's guarded step: host syncs per step
    python benchmarks/gpu_check_pieces.py fp16_overflow  [--dry-run]  # a real GradScaler overflow, end to end
    python benchmarks/gpu_check_pieces.py async_stall    [--dry-run]  # async checkpoint: loop stall, pinned buffers
    python benchmarks/gpu_check_pieces.py cuda_oom       [--dry-run]  # a real CUDA OOM in the attached loop's forward
    python benchmarks/gpu_check_pieces.py rollback_memory [--dry-run] # rollback from pinned host memory vs the files

``--dry-run`` runs the same code tiny on the CPU (so the kit does not rot where no GPU is): there is no
CUDA sync debug mode and no GradScaler there, and the JSON says so (``"cuda": false``) instead of
claiming a GPU figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "benchmarks"))


def _device(dry_run: bool) -> str:
    if dry_run:
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU machine")
    return "cuda"


def _trainer_run(out: str, dry_run: bool, extra: list[str]):
    """A real ``recipes/train.py`` Run (Accelerator, latents, DiT, guard, checkpoints), tiny on CPU."""
    from args import parse_args
    from train import Run, batch_stream

    size = ["--num_videos", "8", "--train_batch_size", "4", "--hidden_size", "32", "--num_heads", "2"] if dry_run else \
        ["--num_videos", "32", "--train_batch_size", "8", "--hidden_size", "256", "--num_heads", "4", "--num_layers", "4"]
    args = parse_args(["--output_dir", out, "--report_to", "none", "--no_async_save", "--lr_warmup_steps", "0",
                       "--max_train_steps", "1000", *size, *extra])
    run = Run(args)
    run.data = batch_stream(run.accelerator, run.dataloader, 0, run.workers)
    return run


def _first_vidstab_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/vidstab/" in f.filename or "/recipes/" in f.filename]
    f = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} in {f.name}"


@contextlib.contextmanager
def count_device_reads(device: str, counts: dict):
    """Count ``Tensor.item/tolist/...`` calls that read a value to the host, by the repository line that made them.

    On CUDA only reads of CUDA tensors count (a CPU tensor's ``.item()``, like AdamW's step counter, is no
    sync). On CPU every tensor is a host tensor, so only reads made by vidstab or the trainer count.
    """
    from bench_guard_overhead import READS

    originals = {n: getattr(torch.Tensor, n) for n in READS}

    def wrap(fn):
        def inner(t, *a, **k):
            caller = traceback.extract_stack(limit=2)[0]  # the line that called .item() / .tolist() / ...
            ours = str(REPO) in caller.filename and "/benchmarks/" not in caller.filename
            if (t.device.type == "cuda") if device == "cuda" else ours:
                where = f"{Path(caller.filename).name}:{caller.lineno}" if ours else f"{Path(caller.filename).name}:{caller.lineno} (library)"
                counts[where] = counts.get(where, 0) + 1
            return fn(t, *a, **k)
        return inner

    for n, fn in originals.items():
        setattr(torch.Tensor, n, wrap(fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)


def sync_debug(dry_run: bool) -> dict:
    """Host syncs per guarded trainer step: counted reads (CPU and GPU) and CUDA's sync debug mode (GPU)."""
    from train import train_step

    device = _device(dry_run)
    with tempfile.TemporaryDirectory() as tmp:
        # param_norm_every=0: the periodic parameter-norm read is a separate, documented sync
        cfg = Path(tmp) / "guard.yaml"
        cfg.write_text("param_norm_every: 0\n")
        run = _trainer_run(str(Path(tmp) / "run"), dry_run, ["--vidstab_config", str(cfg)])
        for step in range(3):  # warm-up: lazy initialisation (cuBLAS handles, allocator) is not a per-step cost
            train_step(run, step)
        reads, where = [], {}
        for step in range(3, 8):
            with count_device_reads(device, {}) as counts:
                train_step(run, step)
            reads.append(sum(counts.values()))
            where.update(counts)
        result = {"piece": "sync_debug", "cuda": device == "cuda", "reads_per_step": reads, "read_sites": sorted(where)}
        if device == "cuda":
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    train_step(run, 8)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            result["cuda_syncs_in_step"] = sum("synchroniz" in str(w.message) for w in caught)
            # "error": the first synchronising call raises; it must be the guard's one read of the step's verdict.
            torch.cuda.set_sync_debug_mode("error")
            try:
                train_step(run, 9)
                result["first_sync"] = None
            except RuntimeError as exc:
                result["first_sync"] = _first_vidstab_frame(exc)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result["ok"] = max(reads) <= 1 and (device != "cuda" or result["cuda_syncs_in_step"] <= 1)
        run.accelerator.end_training()
    return result


def fp16_overflow(dry_run: bool) -> dict:
    """GradScaler starting at 2^30: the first steps overflow for real; the guard must let the scaler skip them
    (applied=False, not a vidstab skip), log them, keep the weights finite and unchanged, and train after."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs

    import vidstab
    from vidstab.reference.model import VideoDiT
    from vidstab.reference.objective import DiffusionObjective, step_generator

    device = _device(dry_run)
    acc = Accelerator(mixed_precision="fp16" if device == "cuda" else "no", cpu=device == "cpu",
                      kwargs_handlers=[GradScalerKwargs(init_scale=2.0**30, growth_interval=10_000)])
    torch.manual_seed(0)
    model = VideoDiT(in_channels=4, hidden_size=64 if dry_run else 256, num_layers=2, num_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    objective = DiffusionObjective()
    latents = torch.randn(4, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0)).to(acc.device)
    with tempfile.TemporaryDirectory() as tmp:
        guard = vidstab.attach(acc, model, opt, config=vidstab.GuardConfig(param_norm_every=0), run_dir=tmp)
        rows = []
        for step in range(25):
            before = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
            draws = objective.sample(latents, step_generator(0, step, 0, 0, latents.device))
            with acc.autocast():
                loss = objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"]).mean()
            guard.backward(loss, batch={"latents": latents}, timesteps=draws["timesteps"])
            result = guard.step(1.0)
            after = list(acc.unwrap_model(model).parameters())
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
            rows.append({"applied": result.applied, "skipped": result.skipped, "unchanged": unchanged,
                         "loss_scale": acc.scaler.get_scale() if acc.scaler is not None else None})
        events = [json.loads(line) for line in (Path(tmp) / "vidstab" / "events-rank0.jsonl").read_text().splitlines()]
    overflows = [e["step"] for e in events if e["kind"] == "overflow"]
    finite = all(torch.isfinite(p).all() for p in acc.unwrap_model(model).parameters())
    skipped_by_scaler = [i for i, r in enumerate(rows) if not r["applied"] and not r["skipped"]]
    out = {"piece": "fp16_overflow", "cuda": device == "cuda", "scaler": acc.scaler is not None, "overflow_steps": overflows,
           "scaler_skips_left_weights_unchanged": all(rows[i]["unchanged"] for i in skipped_by_scaler),
           "final_loss_scale": rows[-1]["loss_scale"], "applied_after": sum(r["applied"] for r in rows[len(overflows):]),
           "weights_finite": bool(finite), "vidstab_skips": sum(r["skipped"] for r in rows)}
    if acc.scaler is not None:
        out["ok"] = bool(overflows) and out["scaler_skips_left_weights_unchanged"] and finite and out["applied_after"] > 0 \
            and out["vidstab_skips"] == 0 and overflows == skipped_by_scaler
    else:  # CPU: no GradScaler, so nothing overflows; the path still ran end to end
        out["ok"] = finite and not overflows and all(r["applied"] for r in rows)
    acc.end_training()
    return out


def async_stall(dry_run: bool) -> dict:
    """How long ``CheckpointManager.save`` blocks the loop with async saves (pinned host buffers on CUDA),
    against a foreground save of the same state."""
    from accelerate import Accelerator

    from vidstab.checkpoint import CheckpointConfig, CheckpointManager

    device = _device(dry_run)
    acc = Accelerator(cpu=device == "cpu")
    width, depth = (256, 4) if dry_run else (4096, 12)  # ~1 MB vs ~800 MB of fp32 weights (+ AdamW state)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, width, device=acc.device)).sum().backward()
    opt.step()
    mb = sum(p.numel() * 4 for p in model.parameters()) * 3 / 2**20
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, async_save in (("sync", False), ("async", True)):
            manager = CheckpointManager(acc, str(Path(tmp) / mode), config=CheckpointConfig(keep=2, async_save=async_save))
            manager.register("model", model)
            manager.register("optimizer", opt)
            stalls, totals = [], []
            for step in range(1, 4):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                manager.save(step)
                stalls.append(time.perf_counter() - t0)
                manager.wait()
                totals.append(time.perf_counter() - t0)
            figures[mode] = {"stall_ms": round(1e3 * sorted(stalls)[1], 1), "total_ms": round(1e3 * sorted(totals)[1], 1)}
    out = {"piece": "async_stall", "cuda": device == "cuda", "state_mb": round(mb, 1),
           "pinned": device == "cuda" and CheckpointConfig().pin_memory, **figures,
           "stall_vs_sync": round(figures["async"]["stall_ms"] / max(figures["sync"]["total_ms"], 1e-6), 3)}
    out["ok"] = math.isfinite(out["stall_vs_sync"]) and (dry_run or out["stall_vs_sync"] < 0.5)
    acc.end_training()
    return out


def cuda_oom(dry_run: bool) -> dict:
    """A real CUDA out-of-memory in the forward of an unmodified attached loop: the per-process memory fraction
    set to what is allocated plus 512 MiB, then a batch whose first layer's output alone is 1 GiB. The step must be
    skipped (an ``oom`` event, no rollback), the memory allocated after it back where it was before the batch, and
    the next (small) step applied. A CPU cannot run out of device memory: without CUDA the piece says so and
    measures nothing."""
    if dry_run or not torch.cuda.is_available():
        return {"piece": "cuda_oom", "cuda": False, "ok": True,
                "skipped": "no CUDA device: a real device OOM (torch.cuda.set_per_process_memory_fraction) cannot be "
                           "provoked on a CPU; nothing measured"}
    from accelerate import Accelerator

    import vidstab

    out = tempfile.mkdtemp(prefix="vidstab-cuda-oom-")
    acc = Accelerator()
    torch.manual_seed(0)
    width = 1024
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, run_dir=out)

    def step(x: torch.Tensor) -> bool:
        loss = model(x).float().square().mean()  # the user's loop, unchanged
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return bool(guard.last_result.applied)

    MiB = 2**20
    first = step(torch.randn(64, width, device=acc.device))  # the optimizer's state exists from here on
    big = torch.randn(262144, width, device=acc.device)  # 1 GiB of input; each layer's output as much again
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(acc.device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + 512 * MiB) / total))
    try:
        big_applied = step(big)
        after = torch.cuda.memory_allocated()
        reserved_after = torch.cuda.memory_reserved()
        del big
        next_applied = step(torch.randn(64, width, device=acc.device))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    guard.close()
    ooms = [{k: e.get(k) for k in ("step", "phase", "micro_batch")} for e in vidstab.read_events(out, "oom")]
    rollbacks = vidstab.read_events(out, ("rollback_request", "rollback"))
    released = after <= before + 8 * MiB  # the stand-in's one-sample graph aside, the failed forward's memory is gone
    ok = first and not big_applied and next_applied and released and [o["phase"] for o in ooms] == ["forward"] \
        and not rollbacks
    return {"piece": "cuda_oom", "cuda": True, "ok": bool(ok), "oom_events": ooms, "big_step_applied": big_applied,
            "next_step_applied": next_applied, "allocated_before_mib": round(before / MiB, 1),
            "allocated_after_skip_mib": round(after / MiB, 1), "reserved_after_skip_mib": round(reserved_after / MiB, 1),
            "released": released, "rollbacks": len(rollbacks)}


def rollback_memory(dry_run: bool) -> dict:
    """An in-place rollback from the copy of the last healthy checkpoint kept in host memory, on the GPU: the copy
    is in pinned memory, the state it restores (weights, every optimizer tensor) is bitwise the one a rollback from
    the files restores, and the seconds of each side by side (``bench_rollback.py --device cuda``, which also checks
    each restore against the saved state)."""
    import shutil

    from bench_rollback import bench_size

    device = _device(dry_run)
    work = tempfile.mkdtemp(prefix="vidstab-gpu-rollback-")
    try:
        sizes = {s: bench_size(s, device, 1 if dry_run else 3, work) for s in (("tiny",) if dry_run else ("small", "base"))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["memory_equals_files"] and r["held_tensors"] > 0 and (dry_run or r["held_pinned"]) for r in sizes.values())
    return {"piece": "rollback_memory", "cuda": device == "cuda", "ok": ok, "sizes": sizes}


PIECES = {"sync_debug": sync_debug, "fp16_overflow": fp16_overflow, "async_stall": async_stall, "cuda_oom": cuda_oom,
          "rollback_memory": rollback_memory}


def _run_piece(name: str, dry_run: bool) -> dict:
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's prints must not break the one JSON line
        return PIECES[name](dry_run)


def _run_into(logs: Path, name: str, dry_run: bool) -> None:
    """``name`` with its output, exit status and seconds in ``logs`` as gpu_check.sh's ``piece`` keeps them."""
    from accelerate.state import AcceleratorState, GradientState

    start, rc = time.time(), 1
    with open(logs / f"{name}.log", "w") as log, contextlib.redirect_stderr(log):
        try:
            result = _run_piece(name, dry_run)
            print(json.dumps(result), file=log)
            rc = 0 if result.get("ok") else 1
        except Exception:  # noqa: BLE001 -- said in its log, the next piece still runs
            traceback.print_exc(file=log)
        finally:
            AcceleratorState._reset_state(True)  # each piece builds its own Accelerator
            GradientState._reset_state()
    (logs / f"{name}.rc").write_text(f"{rc}\n")
    (logs / f"{name}.seconds").write_text(f"{int(time.time() - start)}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("piece", nargs="+", choices=list(PIECES))
    ap.add_argument("--dry-run", action="store_true", help="tiny, on the CPU: checks the kit runs, measures nothing about a GPU")
    ap.add_argument("--logs", type=Path, help="run the pieces in turn in this one interpreter, each one's output, exit "
                    "status and seconds in LOGS/PIECE.log, .rc, .seconds (gpu_check.sh --dry-run: one start-up for all)")
    args = ap.parse_args(argv)
    if args.logs:
        for name in args.piece:
            _run_into(args.logs, name, args.dry_run)
        return 0
    if len(args.piece) > 1:
        ap.error("several pieces need --logs")
    result = _run_piece(args.piece[0], args.dry_run)
    print(json.dumps(result))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
