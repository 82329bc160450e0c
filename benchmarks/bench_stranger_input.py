#!/usr/bin/env python
"""What a stranger's files and a newcomer's first command cost: this tree side by side with a baseline tree.

    python benchmarks/bench_stranger_input.py                       # this tree only
    python benchmarks/bench_stranger_input.py --baseline /path/to/older/checkout

Rows (each a real ``python -m vidstab ...`` process; peak memory is the child's ``ru_maxrss``, capped with
``RLIMIT_AS`` at ``--memory-cap-gb`` so an unbounded baseline cannot take the machine down):

- ``help``: ``vidstab --help`` wall time (median of ``--repeats``) and whether it imported torch;
- ``incidents_120mb``: ``vidstab incidents`` on a run whose ``incident.json`` is 120 MB;
- ``replay_huge_model``: ``vidstab replay`` of a bundle naming a VideoDiT with hidden size 32768 x 24 layers;
- ``quarantine_60mb``: ``vidstab quarantine`` listing a quarantine list of 60 MB (under the 64 MiB cap), and
  ``quarantine_ids_60mb``: what a resuming trainer reads of it (``QuarantineList.ids()``, one call);
- ``quarantine_330mb``: ``vidstab quarantine`` on a 330 MB list (over the cap);
- ``resume_check_300mb_log``: the resume-fidelity check (``vidstab.run.resume_check.ResumeCheck``, run at every
  resume) comparing 3 replayed steps against a 300 MB event log;
- ``load_60mb_manifest``: ``CheckpointManager.load("latest")`` of a checkpoint whose ``manifest.json`` is 60 MB
  (under its cap).

Rows other than ``vidstab`` commands run a snippet in the same probe (``--code``). The last line of output is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PROBE = textwrap.dedent("""
    import resource, runpy, sys
    limit = int(sys.argv.pop(1))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    code = 0
    try:
        if sys.argv[1] == "--code":
            exec(sys.argv[2], {"__name__": "__probe__"})
        else:
            runpy.run_module("vidstab", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except MemoryError:
        code = "MemoryError"
    finally:
        print("PROBE", {"torch": "torch" in sys.modules, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                        "exit": code}, file=sys.stderr)
""")


def probe(tree: Path, args: list[str], cap_bytes: int, cwd: Path) -> dict:
    """One command under ``tree``; run from ``cwd`` (not a checkout: ``-c`` puts the current folder first on
    sys.path). This process never imports torch, so the child's peak memory is its own (Linux carries the peak
    over fork and exec)."""
    started = time.perf_counter()
    # stdout is not kept: a long listing held here would raise the peak memory every later child inherits.
    done = subprocess.run([sys.executable, "-c", PROBE, str(cap_bytes), *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(tree)},
                          cwd=cwd)
    seconds = time.perf_counter() - started
    line = next((x for x in done.stderr.splitlines() if x.startswith("PROBE ")), None)
    out = eval(line[6:]) if line else {"exit": done.returncode, "torch": None, "maxrss_mib": None}  # noqa: S307 - our own dict repr
    out["seconds"] = round(seconds, 2)
    out["said"] = (done.stderr.replace(line or "", "").strip().splitlines() or [""])[-1][:160]
    return out


def make_inputs(work: Path) -> dict[str, list[str]]:
    """Write the hostile inputs (in a child process: this one stays without torch) and return the commands."""
    subprocess.run([sys.executable, __file__, "--write-inputs", str(work)], check=True, cwd=work,
                   env={**os.environ, "PYTHONPATH": str(HERE)})
    return {"incidents_120mb": ["incidents", str(work / "big")],
            "replay_huge_model": ["replay", str(next((work / "huge" / "vidstab" / "incidents").iterdir()))],
            "quarantine_60mb": ["quarantine", str(work / "q60")],
            "quarantine_ids_60mb": ["--code", "from vidstab.recovery.quarantine import QuarantineList\n"
                                    f"print(len(QuarantineList({str(work / 'q60')!r}).ids()))"],
            "quarantine_330mb": ["quarantine", str(work / "q330")],
            "resume_check_300mb_log": ["--code", RESUME_CHECK.format(run=str(work / "log300"), metrics=repr(METRICS))],
            "load_60mb_manifest": ["--code", LOAD_MANIFEST.format(run=str(work / "manifest60"))]}


RESUME_CHECK = textwrap.dedent("""
    from vidstab.events import EventLog
    from vidstab.run.resume_check import ResumeCheck
    check = ResumeCheck({run!r}, rank=0, world_size=1, steps=3)
    check.begin(10)
    log = EventLog({run!r}, rank=0)
    for step in (10, 11, 12):
        log.log("metrics", step, **{metrics})
    log.close()
    print("changes", check.after_step(13))
""")
LOAD_MANIFEST = textwrap.dedent("""
    import torch
    from accelerate import Accelerator
    from vidstab.checkpoint import CheckpointManager
    acc = Accelerator(cpu=True)
    ckpt = CheckpointManager(acc, {run!r})
    ckpt.register("model", torch.nn.Linear(8, 8))
    print("loaded step", ckpt.load("latest")["_checkpoint"]["step"])
""")


def quarantine_list(path: Path, size: int) -> None:
    """``size`` bytes of distinct quarantine lines as vidstab writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        i = written = 0
        while written < size:
            line = json.dumps({"sample_id": f"shard-{i // 1000:05d}/clip-{i:09d}", "reason": "non-finite values in "
                               "latents; absmax outlier", "step": i, "bundle": f"vidstab/incidents/step{i:06d}-rank0",
                               "rank": 0, "source": "capture", "time": 1.7e9}, separators=(",", ":")) + "\n"
            fh.write(line)
            written += len(line)
            i += 1


METRICS = {"loss": 0.5, "lr": 1e-3, "grad_norm": 1.0, "clipped": False, "clip_rate": 0.0, "skipped_total": 0,
           "input_absmax": 3.1, "input_mean": 0.0, "input_std": 1.0, "input_nonfinite": 0, "local_seconds": 0.12,
           "loss_by_t": [0.5] * 10}


def event_log(run: Path, size: int) -> None:
    """A metrics-only event log of ``size`` bytes, steps 0.. (as the guard writes them)."""
    path = run / "vidstab" / "events-rank0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        step = written = 0
        while written < size:
            rec = {"schema": 1, "time": 1.7e9 + step, "step": step, "rank": 0, "kind": "metrics", **METRICS}
            line = json.dumps(rec, separators=(",", ":")) + "\n"
            fh.write(line)
            written += len(line)
            step += 1


def write_inputs(work: Path) -> None:
    import torch

    from vidstab.evidence.capture import write_incident

    spec = {"class": "vidstab.reference.model:VideoDiT", "loss_fn": "vidstab.reference.objective:replay_loss",
            "config": {"in_channels": 4, "hidden_size": 16, "num_layers": 1, "num_heads": 2}}
    batch = {"latents": torch.randn(2, 4, 2, 4, 4), "timesteps": torch.tensor([10, 900]), "noise": torch.randn(2, 4, 2, 4, 4)}

    def bundle(run: Path, model_spec: dict) -> Path:
        return write_incident(run, step=3, micro_step=0, rank=0, world_size=1, batch=batch, sample_ids=["a", "b"],
                              finding={"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN"}, lr=1e-3,
                              precision="no", seed=0, checkpoint=None, model_spec=model_spec)

    big = bundle(work / "big", spec)
    meta = json.loads((big / "incident.json").read_text())
    meta["extra"] = {"padding": ["x" * 1000] * 120_000}
    (big / "incident.json").write_text(json.dumps(meta))
    bundle(work / "huge", {**spec, "config": {"in_channels": 4, "hidden_size": 32768, "num_layers": 24, "num_heads": 8}})
    quarantine_list(work / "q60" / "vidstab" / "quarantine.jsonl", 60 << 20)
    quarantine_list(work / "q330" / "vidstab" / "quarantine.jsonl", 330 << 20)
    event_log(work / "log300", 300 << 20)
    from accelerate import Accelerator

    from vidstab.checkpoint import CheckpointManager
    from vidstab.files.strict_json import dumps_strict

    ckpt = CheckpointManager(Accelerator(cpu=True), str(work / "manifest60"))
    ckpt.register("model", torch.nn.Linear(8, 8))
    folder = Path(ckpt.save(1, trainer_state={"step": 1}))
    ckpt.wait()
    man = json.loads((folder / "manifest.json").read_text())
    man["padding"] = ["x" * 1000] * (60 * 1024)  # an extra field: 60 MB, under the 64 MiB manifest cap
    (folder / "manifest.json").write_text(dumps_strict(man))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, default=None, help="an older checkout to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-cap-gb", type=float, default=6.0)
    ap.add_argument("--write-inputs", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write_inputs:
        write_inputs(args.write_inputs)
        return {}
    cap = int(args.memory_cap_gb * 2**30)
    trees = {"this": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = {"help": ["--help"], **make_inputs(Path(tmp))}
        for name, cli_args in cases.items():
            for tree_name, tree in trees.items():
                runs = [probe(tree, cli_args, cap, Path(tmp)) for _ in range(args.repeats if name == "help" else 1)]
                row = dict(runs[-1], seconds=statistics.median(r["seconds"] for r in runs))
                rows.setdefault(name, {})[tree_name] = row
    print(f"{'case':24s} {'tree':9s} {'seconds':>8s} {'maxrss MiB':>10s} {'torch':>6s}  exit / last line")
    for name, by_tree in rows.items():
        for tree_name, r in by_tree.items():
            print(f"{name:24s} {tree_name:9s} {r['seconds']:8.2f} {str(r['maxrss_mib']):>10s} {str(r['torch']):>6s}  "
                  f"{r['exit']} / {r['said']}")
    summary = {"bench": "stranger_input", "memory_cap_gb": args.memory_cap_gb, "rows": rows}
    print(json.dumps(summary, default=str))
    return summary


if __name__ == "__main__":
    main()
