"""The conformance matrix: every form x engine cell through the same drills (tests/scripts/conformance_drill.py),
the table written into benchmarks/RESULTS.md between its markers.

    python benchmarks/conformance.py [--out DIR] [--ranks16] [--no_write]

Launches, one per world size and kind (a cell's drills share them): ``faults`` (NaN on the last rank, gradient
spike, LR bug for 3 steps, persistent LR fault to the abort, the script's EMA and counter) and ``kill`` (SIGKILL of
the last rank, the form's own resume, under torch elastic restarts); the ``oom_in_step`` column from one
tests/scripts/oom_engines.py launch per world size. The reference trainer's rows: ``recipes/train.py`` on each engine
(DeepSpeed through ``accelerate launch --use_deepspeed``), its own launches (tests/scripts/conformance_reference.py).
``--ranks16``: DDP on 16 processes too (gloo, tiny model; every launch). The last line is one JSON object: per
cell and drill its status, and the seconds of each launch.
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
import conformance_reference as reference  # noqa: E402
import oom_engines  # noqa: E402

FORMS = ("explicit", "attached")  # a launch's last cell ends it: the attached form's exit code
ENGINES = {"single": 1, "ddp": 2, "fsdp2": 2, "zero1": 2, "zero2": 2, "zero3": 2}
BEGIN, END = "<!-- conformance:begin -->", "<!-- conformance:end -->"
COLUMNS = (*drill.DRILLS, "oom_in_step")
"""oom_in_step: for the drill script's rows one tests/scripts/oom_engines.py launch per world size (its assertions:
``oom_engines.evaluate``), for the reference trainer's its faults launch (DeepSpeed: a launch of its own)."""


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
        for kind in ("faults", "kill"):
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
    two = sorted(cells_of(2), key=lambda c: "zero" not in c)  # the last cell not DeepSpeed: every rank's fault
    for world, cells, tag in [(1, cells_of(1), ""), (2, two, "")] + [p for p in plan if p[2]]:
        start = time.perf_counter()
        folder = out / f"oom{world}"
        proc = oom_launch(cells, folder, world)
        seconds[f"oom_in_step@{world}"] = round(time.perf_counter() - start, 1)
        (folder / "launch.log").write_text(proc.stdout + proc.stderr)
        for cell in cells:
            form, engine = cell.split(":")
            results[cell + tag]["oom_in_step"] = oom_engines.evaluate(folder / f"{form}-{engine}", form, engine, world)
    for engine in reference.ENGINES:
        results[f"reference:{engine}"] = reference_row(out / "reference" / engine, engine, seconds)
    return results, seconds


def oom_launch(cells: list[str], folder: Path, world: int):
    """tests/scripts/oom_engines.py over ``cells`` (torchrun, ``world`` processes), as tests/test_oom_engines.py."""
    import os
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it would turn DeepSpeed off
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(reference._port()), oom_engines.__file__, "--out", str(folder),
           "--cells", ",".join(cells)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)


def reference_row(folder: Path, engine: str, seconds: dict) -> dict:
    """``recipes/train.py``'s launches for ``engine`` (tests/scripts/conformance_reference.py), judged."""
    procs = {}
    for kind in reference.kinds(engine):
        start = time.perf_counter()
        procs[kind] = reference.launch(engine, kind, folder, timeout=1800)
        seconds[f"reference-{engine}-{kind}"] = round(time.perf_counter() - start, 1)
    row = reference.evaluate_faults(folder / "faults", engine, procs["faults"], procs.get("ema_refusal"))
    row["kill_resume"] = reference.evaluate_kill(folder / "kill", engine, procs["kill"])
    if "oom" in procs:
        row["oom_in_step"] = reference.evaluate_oom_stop(folder / "oom", engine, procs["oom"])
    return row


def table(results: dict) -> str:
    mark = {"pass": "pass", "fail": "**fail**", "refused": "refused at setup", "warned": "fails, warned at attach",
            "refused_resume": "warned at attach, its resume refused",
            "stopped": "stops with a message", "n/a": "n/a"}
    lines = ["| form | engine | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    said: dict[str, list[str]] = {}
    for cell, row in results.items():
        form, engine = cell.split(":")
        cols = []
        for d in COLUMNS:
            r = row.get(d)
            if r is None:
                cols.append("not run")
                continue
            cols.append(mark[r["status"]])
            if r.get("why"):  # a reason shared by several cells: said once
                said.setdefault(r["why"], []).append(f"{form} / {engine} / {d}")
        lines.append(f"| {form} | {engine} | " + " | ".join(cols) + " |")
    return "\n".join(lines + [""] + [f"- {'; '.join(cells)}: {why}" for why, cells in said.items()] + [
        "- reference: recipes/train.py, judged from what it writes (tests/scripts/conformance_reference.py): skips "
        "by detector and step on every rank; persistent: 3 rollbacks, the LR halved each time, stop with exit code 3; "
        "ema: every kept checkpoint's EMA finite and having taken exactly the applied steps of the trajectory to it; "
        "kill_resume: the replayed steps' loss, gradient norm and LR bitwise the first attempt's"])


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
    ap.add_argument("--out", default=None, help="an empty or new folder for the runs (default: a new temporary one)")
    ap.add_argument("--ranks16", action="store_true")
    ap.add_argument("--no_write", action="store_true")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="conformance-"))
    if out.is_dir() and any(out.iterdir()):  # the launches append to their event logs: earlier runs would be judged too
        ap.error(f"--out {out} is not empty: give a new folder (earlier runs' event logs would be judged with these)")
    results, seconds = run_matrix(out, args.ranks16)
    text = table(results)
    print(text)
    if not args.no_write:
        write_results(text)
    print(json.dumps({"results": results, "seconds": seconds, "out": str(out)}))


if __name__ == "__main__":
    main()
