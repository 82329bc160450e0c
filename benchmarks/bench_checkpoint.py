#!/usr/bin/env python
"""Claim: a durable, validated vidstab checkpoint costs about what a bare safetensors dump costs, and an
async save stalls the training loop for a small fraction of that.

On the same state (a ~50 MB fp32 model + its AdamW state, CPU) this times, median of ``--repeats``:

* ``bare``        ``safetensors.torch.save_file`` of the model and optimizer tensors + fsync (the floor:
                  no structure, no manifest, no atomic rename);
* ``crc32_only`` / ``sha256_only``  checksumming the same bytes once (no I/O): with ``bare`` the floor of
                  a save that checksums every byte, max(bare, crc32_only) for the default;
* ``vidstab_sync`` ``CheckpointManager.save`` with ``async_save=False`` and the default checksum (CRC-32):
                  every file checksummed while written and fsync'd, manifest, atomic rename, pointers,
                  rotation; ``vidstab_sync_sha256`` the same with ``checksum="sha256"``;
* ``vidstab_async_stall`` the time ``save`` blocks the loop with ``async_save=True`` (the host copy), and
                  ``vidstab_async_total`` until ``wait()`` returns (default checksum);
* ``accelerate_save_state`` ``accelerator.save_state`` (pickles the optimizer, no fsync, not atomic).

Targets (default checksum): vidstab_sync <= 1.25 x bare; vidstab_async_stall <= 0.2 x vidstab_sync.
CRC-32 (~5 GB/s per core) stays below page cache + fsync; sha256 (~1.4 GB/s per core) does not on a fast
disk, which is why it is opt-in (``sync_sha256_vs_bare``). vidstab starts writeback every 16 MiB while it
writes (``bare`` does not), so its final fsync overlaps the copy instead of following it. Background
deletions of rotated checkpoints are finished (untimed) before each vidstab method.

``--fsdp`` (2 processes, torchrun, FSDP2 ``fully_shard`` per layer on a gloo CPU mesh; the script launches
itself): on the same sharded model + AdamW state, median of ``--repeats``, each method ending when every rank
is done:

* ``dcp_save``     plain ``torch.distributed.checkpoint.save`` of the model and flattened optimizer state
                   (default FileSystemWriter: streams each tensor, fsync'd, pickled ``.metadata``, no
                   manifest/rename/pointers);
* ``dcp_save_hf``  the same with torch's stock ``HuggingFaceStorageWriter(save_distributed=True)`` (one
                   safetensors shard per rank serialised in memory first, fsync'd; no pickle, no checksums);
* ``vidstab_sharded_sync`` ``CheckpointManager.save`` (sharded backend, ``async_save=False``): DCP through
                   the HF safetensors format (each rank's shard streamed from memory, checksummed while
                   written), fsync'd in one batch, ranks agree, manifest, atomic rename, pointers, rotation;
* ``vidstab_sharded_async_stall`` / ``_total`` ``save`` with ``async_save=True`` (``dcp.async_save`` on the
                   checkpoint gloo group: the stall is its host-memory staging) and until ``wait()``;
* ``accelerate_save_state`` ``accelerator.save_state`` with the model registered for checkpointing
                   (``torch.save`` pickles of the sharded state, main process, no fsync);
* ``host_copy_floor`` each rank's local shards and optimizer moments copied once into host buffers it
                   already holds (``torch._foreach_copy_``): the floor of any async stall.

Targets: vidstab_sharded_sync <= 1.3 x dcp_save; async stall <= 0.2 x vidstab_sharded_sync. Methods run
interleaved, one of each per repeat, in the order listed.
The last line of output is one JSON object.
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
from accelerate import Accelerator
from safetensors.torch import save_file

from vidstab.files import statedict_io as sio
from vidstab.files.atomic import fsync_paths
from vidstab.checkpoint import CheckpointConfig, CheckpointManager


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def build(width: int, depth: int):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, width)).square().mean().backward()
    opt.step()  # materialise exp_avg / exp_avg_sq
    opt.zero_grad()
    return acc, model, opt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fsdp", action="store_true", help="2-process FSDP2 sharded checkpoints (see above)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=12, help="Linear(width, width) layers; 12 x 1024 -> ~50 MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    a = p.parse_args(argv)
    if a.fsdp:
        return fsdp_main(a, argv if argv is not None else sys.argv[1:])

    # On a small shared CPU box torch's intra-op threads mostly spin against each other (a 4 MB copy_
    # can take 100 ms under load); one thread measures the checkpoint code, not the contention.
    torch.set_num_threads(a.threads)
    acc, model, opt = build(a.width, a.depth)
    n_params = sum(p.numel() for p in model.parameters())
    work = tempfile.mkdtemp(prefix="vidstab-bench-ckpt-", dir=a.dir)
    times: dict[str, list[float]] = {k: [] for k in ("bare", "crc32_only", "sha256_only", "vidstab_sync",
                                                     "vidstab_sync_sha256", "vidstab_async_stall",
                                                     "vidstab_async_total", "accelerate_save_state")}
    sizes: dict[str, int] = {}

    def bare(out: str) -> None:
        os.makedirs(out)
        msd = {k: v.contiguous() for k, v in acc.get_state_dict(model).items()}
        tensors, _ = sio.flatten(opt.state_dict())
        for name, t in (("model.safetensors", msd), ("optimizer.safetensors", tensors)):
            path = os.path.join(out, name)
            save_file(t, path)
            fsync_paths([path])

    def checksum_only(algo: str) -> None:
        # The floor for any save that checksums every byte: one core over the state.
        h = sio.new_checksum(algo)
        for t in list(acc.get_state_dict(model).values()) + list(sio.flatten(opt.state_dict())[0].values()):
            h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

    def settle() -> None:
        # Every manager's rotation frees the rotated checkpoint's bytes in a background thread: let those
        # finish so that no method is timed while another one's rmtree runs (the others rmtree untimed too).
        for m in managers.values():
            m.wait()

    managers = {}
    for mode, cfg in (("sync", dict(async_save=False)), ("sync_sha256", dict(async_save=False, checksum="sha256")),
                      ("async", dict(async_save=True))):
        m = CheckpointManager(acc, os.path.join(work, f"vidstab_{mode}"), CheckpointConfig(keep=1, **cfg))
        m.register("model", model)
        m.register("optimizer", opt)
        managers[mode] = m

    try:
        for rep in range(a.repeats):
            # Interleave the methods so that disk-speed drift hits all of them alike.
            out = os.path.join(work, f"bare{rep}")
            os.sync()  # no dirty data left by the previous method (accelerate's is never fsync'd)
            t = time.perf_counter()
            bare(out)
            times["bare"].append(time.perf_counter() - t)
            sizes["bare"] = dir_bytes(out)
            shutil.rmtree(out)

            for algo in ("crc32", "sha256"):
                os.sync()  # no dirty data left by the previous method (accelerate's is never fsync'd)
                t = time.perf_counter()
                checksum_only(algo)
                times[f"{algo}_only"].append(time.perf_counter() - t)
                sizes[f"{algo}_only"] = sizes["bare"]

            for mode in ("sync", "sync_sha256"):
                settle()
                os.sync()  # no dirty data left by the previous method (accelerate's is never fsync'd)
                t = time.perf_counter()
                path = managers[mode].save(rep + 1, healthy=True, trainer_state={"step": rep + 1})
                times[f"vidstab_{mode}"].append(time.perf_counter() - t)
                sizes[f"vidstab_{mode}"] = dir_bytes(path)

            settle()
            os.sync()  # no dirty data left by the previous method (accelerate's is never fsync'd)
            t = time.perf_counter()
            path = managers["async"].save(rep + 1, healthy=True, trainer_state={"step": rep + 1})
            times["vidstab_async_stall"].append(time.perf_counter() - t)
            managers["async"].wait()
            times["vidstab_async_total"].append(time.perf_counter() - t)
            sizes["vidstab_async_total"] = sizes["vidstab_async_stall"] = dir_bytes(path)

            out = os.path.join(work, f"accelerate{rep}")
            os.sync()  # no dirty data left by the previous method (accelerate's is never fsync'd)
            t = time.perf_counter()
            acc.save_state(out)
            times["accelerate_save_state"].append(time.perf_counter() - t)
            sizes["accelerate_save_state"] = dir_bytes(out)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state: {n_params / 1e6:.1f} M params fp32 + AdamW ({sizes['bare'] / 1e6:.0f} MB), "
          f"median of {a.repeats}, torch {torch.__version__}")
    print(f"{'method':<24}{'seconds':>10}{'MB':>9}{'x bare':>9}{'MB/s':>9}")
    for k, v in med.items():
        print(f"{k:<24}{v:>10.3f}{sizes[k] / 1e6:>9.1f}{v / med['bare']:>9.2f}{sizes[k] / 1e6 / v:>9.0f}")
    res = {
        "bench": "checkpoint",
        "params_m": round(n_params / 1e6, 2),
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "bytes": sizes,
        "sync_vs_bare": round(med["vidstab_sync"] / med["bare"], 3),
        "sync_vs_floor": round(med["vidstab_sync"] / max(med["bare"], med["crc32_only"]), 3),
        "sync_sha256_vs_bare": round(med["vidstab_sync_sha256"] / med["bare"], 3),
        "async_stall_vs_sync": round(med["vidstab_async_stall"] / med["vidstab_sync"], 3),
        "accelerate_vs_bare": round(med["accelerate_save_state"] / med["bare"], 3),
    }
    res["targets_met"] = res["sync_vs_bare"] <= 1.25 and res["async_stall_vs_sync"] <= 0.2
    print(f"vidstab sync (crc32) = {res['sync_vs_bare']:.2f} x bare (target <= 1.25); with sha256 = "
          f"{res['sync_sha256_vs_bare']:.2f} x bare; async stall = "
          f"{res['async_stall_vs_sync']:.2f} x sync (target <= 0.2); accelerate save_state = "
          f"{res['accelerate_vs_bare']:.2f} x bare")
    print(json.dumps(res))
    return 0


def fsdp_main(a: argparse.Namespace, argv: list[str]) -> int:
    """``--fsdp``: relaunch on 2 processes under torchrun, then time each method on every rank."""
    if "RANK" not in os.environ:
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), os.path.abspath(__file__), *argv]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(a.threads)
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.depth)])
    mesh = init_device_mesh("cpu", (acc.num_processes,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, a.width)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt = acc.prepare(opt)
    acc.register_for_checkpointing(model)
    n_params = sum(p.numel() for p in model.parameters())  # DTensor numel: the global count
    work = tempfile.mkdtemp(prefix="vidstab-bench-fsdp-", dir=a.dir) if rank == 0 else None
    holder = [work]
    dist.broadcast_object_list(holder, src=0)  # a path string between our own two processes
    work = holder[0]
    times: dict[str, list[float]] = {k: [] for k in ("dcp_save", "dcp_save_hf", "vidstab_sharded_sync", "vidstab_sharded_async_stall",
                                                     "vidstab_sharded_async_total", "accelerate_save_state", "host_copy_floor")}
    sizes: dict[str, int] = {}
    managers = {mode: CheckpointManager(acc, os.path.join(work, f"vidstab_{mode}"),
                                        CheckpointConfig(keep=1, async_save=mode == "async"))
                for mode in ("sync", "async")}
    for m in managers.values():
        m.register("model", model)
        m.register("optimizer", opt)

    def timed(key: str, fn) -> float:
        for m in managers.values():
            m.wait()  # rotated checkpoints' background deletes finish untimed
        if rank == 0:
            os.sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()  # the method is done when every rank is
        el = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        times[key].append(float(el))
        return float(el)

    def local_tensors() -> list[torch.Tensor]:
        """This rank's share of the state, as the async stager copies it: local shards and optimizer moments."""
        shards = [getattr(p, "_local_tensor", p).detach() for p in model.parameters()]
        moments = [v for st in opt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
        return [getattr(t, "_local_tensor", t) for t in shards + moments]

    copy_buffers = [torch.empty_like(t) for t in local_tensors()]  # reused, as the stager's are
    copied = torch.tensor([sum(b.numel() * b.element_size() for b in copy_buffers)], dtype=torch.float64)
    dist.all_reduce(copied)  # both ranks' bytes, as the folders' sizes are

    def host_copy() -> None:
        """The floor of any async stall: one copy of this rank's state into host buffers it already has."""
        torch._foreach_copy_(copy_buffers, local_tensors())

    def plain_dcp(out: str, hf: bool = False) -> None:
        flat = get_optimizer_state_dict(model, opt.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        state = {"model": get_model_state_dict(model), "optimizer": flat}
        if hf:
            dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(out, save_distributed=True))
        else:
            dcp.save(state, checkpoint_id=out)

    try:
        for rep in range(a.repeats):
            for key, hf in (("dcp_save", False), ("dcp_save_hf", True)):
                out = os.path.join(work, f"{key}{rep}")
                timed(key, lambda: plain_dcp(out, hf))
                sizes[key] = dir_bytes(out)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(out)
            path = [None]
            timed("vidstab_sharded_sync", lambda: path.__setitem__(0, managers["sync"].save(rep + 1, trainer_state={})))
            sizes["vidstab_sharded_sync"] = dir_bytes(path[0])
            stall = [0.0]

            def async_save():
                t = time.perf_counter()
                path[0] = managers["async"].save(rep + 1, trainer_state={})
                stall[0] = time.perf_counter() - t
                managers["async"].wait()
            timed("vidstab_sharded_async_total", async_save)
            el = torch.tensor([stall[0]], dtype=torch.float64)
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            times["vidstab_sharded_async_stall"].append(float(el))
            sizes["vidstab_sharded_async_total"] = sizes["vidstab_sharded_async_stall"] = dir_bytes(path[0])
            timed("host_copy_floor", host_copy)
            sizes["host_copy_floor"] = int(copied)
            out = os.path.join(work, f"accelerate{rep}")
            timed("accelerate_save_state", lambda: acc.save_state(out))
            sizes["accelerate_save_state"] = dir_bytes(out)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(out)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    if rank != 0:
        return 0
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state: FSDP2 on 2 processes, {n_params / 1e6:.1f} M params fp32 + AdamW, sharded, median of {a.repeats}, "
          f"torch {torch.__version__}")
    print(f"{'method':<30}{'seconds':>10}{'MB':>9}{'x dcp.save':>12}{'x dcp.save HF':>15}")
    for k, v in med.items():
        print(f"{k:<30}{v:>10.3f}{sizes[k] / 1e6:>9.1f}{v / med['dcp_save']:>12.2f}{v / med['dcp_save_hf']:>15.2f}")
    res = {
        "bench": "checkpoint_fsdp",
        "world_size": acc.num_processes,
        "params_m": round(n_params / 1e6, 2),
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "bytes": sizes,
        "sharded_sync_vs_dcp_save": round(med["vidstab_sharded_sync"] / med["dcp_save"], 3),
        "sharded_sync_vs_dcp_save_hf": round(med["vidstab_sharded_sync"] / med["dcp_save_hf"], 3),
        "async_stall_vs_sync": round(med["vidstab_sharded_async_stall"] / med["vidstab_sharded_sync"], 3),
        "async_stall_vs_host_copy": round(med["vidstab_sharded_async_stall"] / med["host_copy_floor"], 3),
        "accelerate_vs_dcp_save": round(med["accelerate_save_state"] / med["dcp_save"], 3),
    }
    res["targets_met"] = res["sharded_sync_vs_dcp_save"] <= 1.3 and res["async_stall_vs_sync"] <= 0.2
    print(f"vidstab sharded save = {res['sharded_sync_vs_dcp_save']:.2f} x plain dcp.save (target <= 1.3), "
          f"{res['sharded_sync_vs_dcp_save_hf']:.2f} x dcp.save with the stock HF writer; async "
          f"stall = {res['async_stall_vs_sync']:.2f} x sync (target <= 0.2), {res['async_stall_vs_host_copy']:.2f} x "
          f"the bare host copy of the same state; accelerate save_state = "
          f"{res['accelerate_vs_dcp_save']:.2f} x dcp.save")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
