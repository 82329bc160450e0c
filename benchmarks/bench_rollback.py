#!/usr/bin/env python
"""Claim: an in-place rollback restores from the copy of the last healthy checkpoint kept in host memory faster
than from the checkpoint's files, to the same bits.

For the reference VideoDiT (``vidstab.reference.model``) at two sizes of ``benchmarks/bench_model.py``'s
``SIZES``, with AdamW state (one optimizer step on random gradients) and a LambdaLR scheduler, one healthy
checkpoint is saved with the default :class:`~vidstab.checkpoint.CheckpointConfig` (async save, CRC-32,
``rollback_memory_budget_bytes`` default), then the weights are perturbed and rolled back with
``CheckpointManager.load("last_good", resume_event=False, from_memory=...)`` -- the load
:class:`vidstab.Recovery` does at a rollback -- median of ``--repeats``, interleaved:

* ``memory``      from the kept host copy (no file read; decode, optimizer state cloned, applied);
* ``files_warm``  from the files, which the page cache still holds (read, every byte checksummed, decoded, applied);
* ``files_cold``  the same after ``posix_fadvise(DONTNEED)`` on every file of the checkpoint, so that it is read
                  from the disk (what a rollback long after the save pays; best effort: the kernel may keep pages).

Every restore is checked bitwise against the saved weights and optimizer moments. ``--device cuda`` puts the model
on the GPU (the copy is then pinned: ``held_pinned``). ``memory_equals_files``: the whole restored state (weights,
every optimizer tensor) after the rollback from memory equals, bitwise, the one after the rollback from the files.
The last line of output is one JSON object.

    python benchmarks/bench_rollback.py                  # CPU: sizes tiny,small
    python benchmarks/bench_rollback.py --sizes small,base --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import SIZES  # noqa: E402

METHODS = ("memory", "files_warm", "files_cold")


def evict(folder: str) -> None:
    """Ask the kernel to drop the checkpoint's pages from the page cache (clean pages: no root needed)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_size(size_name: str, device: str, repeats: int, work: str) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from vidstab.checkpoint import CheckpointConfig, CheckpointManager
    from vidstab.reference.model import VideoDiT

    size = SIZES[size_name]
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=device == "cpu")
    torch.manual_seed(0)
    model = VideoDiT(in_channels=size.channels, patch_size=(1, 2, 2), hidden_size=size.hidden, num_layers=size.layers,
                     num_heads=size.heads, mlp_ratio=size.mlp_ratio, pos_embed="rope", qk_norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    for p in model.parameters():  # AdamW's moments, without a forward pass
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    out = os.path.join(work, size_name)
    ckpt = CheckpointManager(acc, out, CheckpointConfig(keep=2))
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched)):
        ckpt.register(name, obj)
    path = ckpt.save(1, healthy=True, trainer_state={"step": 1})
    ckpt.wait()
    want_w = [p.detach().clone() for p in model.parameters()]
    want_m = [s["exp_avg_sq"].clone() for s in opt.state.values()]
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))

    def state() -> list[torch.Tensor]:
        """Every tensor a rollback restores here: the weights and the optimizer's whole state."""
        return [t.detach().clone() for t in model.state_dict().values()] + [
            v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]

    def restore(method: str) -> float:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for s in opt.state.values():
                s["exp_avg_sq"].mul_(2.0)
        if method == "files_cold":
            evict(path)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        state = ckpt.load("last_good", resume_event=False, from_memory=method == "memory")
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        assert state["_checkpoint"]["source"] == ("memory" if method == "memory" else "files"), state["_checkpoint"]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want_w)), method
        assert all(torch.equal(s["exp_avg_sq"], m) for s, m in zip(opt.state.values(), want_m)), method
        return seconds

    times: dict[str, list[float]] = {m: [] for m in METHODS}
    restored: dict[str, list[torch.Tensor]] = {}
    for _ in range(repeats):
        for m in METHODS:
            times[m].append(restore(m))
            restored.setdefault(m, state())
    ckpt.wait()
    # The kept copy's tensors (CUDA: in pinned host memory, so the copy back to the device is a DMA).
    held = [t for spec in (ckpt.memory.payload(path) or {}).values() if isinstance(spec, dict) for t in spec.values()]
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"params_m": round(n_params / 1e6, 2), "state_mb": round(state_bytes / 1e6, 1),
            "held_mb": round(ckpt.memory.bytes / 1e6, 1), "held_tensors": len(held),
            "held_pinned": bool(held) and all(t.is_pinned() for t in held),
            "memory_equals_files": all(torch.equal(a, b) for a, b in zip(restored["memory"], restored["files_warm"]))
            and len(restored["memory"]) == len(restored["files_warm"]),
            "seconds": {m: round(v, 4) for m, v in med.items()},
            "files_warm_vs_memory": round(med["files_warm"] / med["memory"], 2),
            "files_cold_vs_memory": round(med["files_cold"] / med["memory"], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help=f"two of {list(SIZES)} (default: tiny,small on cpu; small,base on cuda)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = (a.sizes or ("tiny,small" if a.device == "cpu" else "small,base")).split(",")
    work = tempfile.mkdtemp(prefix="vidstab-bench-rollback-", dir=a.dir)
    try:
        results = {s: bench_size(s, a.device, a.repeats, work) for s in sizes}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"rollback restore seconds, median of {a.repeats}, {a.device}, torch {torch.__version__} "
          "(model + AdamW + scheduler; bitwise checked)")
    print(f"{'size':<8}{'params M':>9}{'state MB':>10}{'memory':>10}{'files warm':>12}{'files cold':>12}"
          f"{'warm/mem':>10}{'cold/mem':>10}")
    for s, r in results.items():
        sec = r["seconds"]
        print(f"{s:<8}{r['params_m']:>9}{r['state_mb']:>10}{sec['memory']:>10.4f}{sec['files_warm']:>12.4f}"
              f"{sec['files_cold']:>12.4f}{r['files_warm_vs_memory']:>10}{r['files_cold_vs_memory']:>10}")
    res = {"bench": "rollback", "device": a.device, "repeats": a.repeats, "sizes": results,
           "memory_faster": all(r["seconds"]["memory"] < r["seconds"]["files_warm"] for r in results.values())}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
