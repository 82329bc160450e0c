"""The conformance matrix: every form x engine cell through the same drills (tests/scripts/conformance_drill.py),
the table written into benchmarks/RESULTS.md between its markers.

    python benchmarks/conformance.py [--out DIR] [--ranks16] [--no_write]

Launches, one per world size and kind (a cell's drills share them): ``faults`` (NaN on the last rank, gradient
spike, LR bug for 3 steps, persistent LR fault to the abort, the script's EMA and counter) and ``kill`` (SIGKILL of
the last rank, the form's own resume, under torch elastic restarts). ``--ranks16``: DDP on 16 processes too
(gloo, tiny model; the faults launch). The last line is one JSON object: per cell and drill its status, and
the seconds of each launch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "scripts"))
import conformance_drill as drill  # noqa: E402

FORMS = ("explicit", "attached")  # a launch's last cell ends it: the attached form's exit code
ENGINES = {"single": 1, "ddp": 2, "fsdp2": 2, "zero1": 2, "zero2": 2, "zero3": 2}
BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
REFERENCE_TRAINER = ("reference trainer (recipes/train.py)", "not in this matrix yet: its own drills are "
                     "tests/test_train.py and tests/test_resilience.py")


def cells_of(world: int, engines=ENGINES) -> list[str]:
    return [f"{form}:{engine}" for engine, n in engines.items() if n == world for form in FORMS]


def run_matrix(out: Path, ranks16: bool = False) -> tuple[dict, dict]:
    """(results: ``{"form:engine[@16]": {drill: {"status", "why"?}}}``, seconds per launch)."""
    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    plan = [(world, cells_of(world), "") for world in sorted(set(ENGINES.values()))]
    if ranks16:
        plan.append((16, [f"{form}:ddp" for form in FORMS], "@16"))
    for world, cells, tag in plan:
        folder = out / f"world{world}"
        for kind in ("faults", "kill") if not tag else ("faults",):
            start = time.perf_counter()
            proc = drill.launch(cells, kind, folder, world, timeout=1800)
            seconds[f"{kind}@{world}"] = round(time.perf_counter() - start, 1)
            (folder / f"{kind}.log").write_text(proc.stdout + proc.stderr)
            for cell in cells:
                form, engine = cell.split(":")
                row = results.setdefault(cell + tag, {})
                where = folder / f"{form}-{engine}"
                if kind == "faults":
                    row.update(drill.evaluate_faults(where, form, world))
                else:
                    row["kill_resume"] = drill.evaluate_kill(where, world)
                    if proc.returncode != 0 and row["kill_resume"]["status"] == "pass":
                        row["kill_resume"] = {"status": "fail", "why": f"the launch exited {proc.returncode}"}
    return results, seconds


def table(results: dict) -> str:
    mark = {"pass": "pass", "fail": "**fail**", "refused": "refused at setup", "warned": "fails, warned at attach"}
    lines = ["| form | engine | " + " | ".join(drill.DRILLS) + " |", "|---|---|" + "---|" * len(drill.DRILLS)]
    notes = []
    for cell, row in results.items():
        form, engine = cell.split(":")
        cols = []
        for d in drill.DRILLS:
            r = row.get(d)
            if r is None:
                cols.append("not run")
                continue
            cols.append(mark[r["status"]])
            if r.get("why"):
                notes.append(f"- {form} / {engine} / {d}: {r['why']}")
        lines.append(f"| {form} | {engine} | " + " | ".join(cols) + " |")
    lines.append(f"| {REFERENCE_TRAINER[0]} | | " + " | ".join(["not run"] * len(drill.DRILLS)) + " |")
    return "\n".join(lines + [""] + notes + [f"- {REFERENCE_TRAINER[0]}: {REFERENCE_TRAINER[1]}"])


def write_results(text: str, path: Path = REPO / "benchmarks" / "RESULTS.md") -> None:
    body = path.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in body:
        body = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, body, flags=re.S)
    else:
        body += "\n## Conformance matrix (benchmarks/conformance.py)\n\n" + block + "\n"
    path.write_text(body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ranks16", action="store_true")
    ap.add_argument("--no_write", action="store_true")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="conformance-"))
    results, seconds = run_matrix(out, args.ranks16)
    text = table(results)
    print(text)
    if not args.no_write:
        write_results(text)
    print(json.dumps({"results": results, "seconds": seconds, "out": str(out)}))


if __name__ == "__main__":
    main()
