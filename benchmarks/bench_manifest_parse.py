#!/usr/bin/env python
"""One resume (``CheckpointManager.load("latest")``) of a run whose newest manifest is ~59 MB, under the 64 MiB
cap: wall time, peak memory and how many times a manifest was parsed, this tree side by side with a baseline.

    python benchmarks/bench_manifest_parse.py                          # this tree only
    python benchmarks/bench_manifest_parse.py --baseline /path/to/older/checkout

Each row is a fresh process (``PYTHONPATH`` = the tree) loading the same run folder, written once by this
tree (three checkpoints of a tiny model; the newest manifest padded with an extra field, which readers
ignore). ``manifest_parses`` counts every manifest parsed (three folders: three at best). Peak memory is the child's ``ru_maxrss``. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MAKE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from checkpoint_drills import train_and_save, manifest, write_manifest
    t = train_and_save(Path(sys.argv[1]), [2, 4, 6])
    man = manifest(t.folder(6))
    man["pad"] = [[i, i * 0.5, "x"] for i in range(int(sys.argv[3]))]
    write_manifest(t.folder(6), man)
    print((t.folder(6) / "manifest.json").stat().st_size)
""")
LOAD = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import vidstab.checkpoint.layout as layout
    from checkpoint_drills import Trainee
    assert layout.__file__.startswith(sys.argv[3]), (layout.__file__, sys.argv[3])
    parses = 0
    real = layout.loads_bounded
    def counting(data, what, **kw):
        global parses
        parses += what == layout.MANIFEST
        return real(data, what, **kw)
    layout.loads_bounded = counting
    t = Trainee(Path(sys.argv[1]))
    t0 = time.perf_counter()
    state = t.ckpt.load("latest")
    seconds = time.perf_counter() - t0
    print(json.dumps({"step": state["step"], "load_s": round(seconds, 2), "manifest_parses": parses,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
""")


def run(tree: Path, code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    # From a folder that is no checkout: ``-c`` puts the current folder first on sys.path.
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=3600,
                          cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, default=None, help="an older checkout to compare with")
    p.add_argument("--entries", type=int, default=2_300_000, help="padding entries (2.3M: a 58.8 MB manifest)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vidstab-bench-manifest-") as work:
        run_dir = Path(work) / "run"
        size = int(run(HERE, MAKE, str(run_dir), str(HERE / "tests"), str(args.entries)))
        print(f"newest manifest: {size / 1e6:.1f} MB")
        rows = {"this": json.loads(run(HERE, LOAD, str(run_dir), str(HERE / "tests"), str(HERE)))}
        if args.baseline is not None:
            # the baseline tree's own test helpers, with its own vidstab
            rows["baseline"] = json.loads(run(args.baseline, LOAD, str(run_dir), str(args.baseline / "tests"),
                                              str(args.baseline.resolve())))
        for name, row in rows.items():
            print(f"{name:9s} load {row['load_s']:8.2f} s  peak RSS {row['peak_rss_mib']:6d} MiB  "
                  f"manifest parses {row['manifest_parses']}")
    print(json.dumps({"manifest_bytes": size, **rows}))


if __name__ == "__main__":
    main()
