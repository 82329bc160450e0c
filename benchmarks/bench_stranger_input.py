#!/usr/bin/env python
"""What a stranger's files and a newcomer's first command cost: this tree side by side with a baseline tree.

    python benchmarks/bench_stranger_input.py                       # this tree only
    python benchmarks/bench_stranger_input.py --baseline /path/to/older/checkout

Rows (each a real ``python -m vidstab ...`` process; peak memory is the child's ``ru_maxrss``, capped with
``RLIMIT_AS`` at ``--memory-cap-gb`` so an unbounded baseline cannot take the machine down):

- ``help``: ``vidstab --help`` wall time (median of ``--repeats``) and whether it imported torch;
- ``incidents_120mb``: ``vidstab incidents`` on a run whose ``incident.json`` is 120 MB;
- ``replay_huge_model``: ``vidstab replay`` of a bundle naming a VideoDiT with hidden size 32768 x 24 layers.

The last line of output is one JSON object.
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
    done = subprocess.run([sys.executable, "-c", PROBE, str(cap_bytes), *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=cwd)
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
            "replay_huge_model": ["replay", str(next((work / "huge" / "vidstab" / "incidents").iterdir()))]}


def write_inputs(work: Path) -> None:
    import torch

    from vidstab.capture import write_incident

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
    print(f"{'case':20s} {'tree':9s} {'seconds':>8s} {'maxrss MiB':>10s} {'torch':>6s}  exit / last line")
    for name, by_tree in rows.items():
        for tree_name, r in by_tree.items():
            print(f"{name:20s} {tree_name:9s} {r['seconds']:8.2f} {str(r['maxrss_mib']):>10s} {str(r['torch']):>6s}  "
                  f"{r['exit']} / {r['said']}")
    summary = {"bench": "stranger_input", "memory_cap_gb": args.memory_cap_gb, "rows": rows}
    print(json.dumps(summary, default=str))
    return summary


if __name__ == "__main__":
    main()
