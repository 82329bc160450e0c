"""Launched by tests/test_oom_engines.py on 2 CPU processes (torchrun): an out-of-memory inside
``optimizer.step()`` (the ``oom_in_step`` drill) under FSDP2 and DeepSpeed ZeRO 1/2/3, in the attached and the
explicit form, cells one after another (the engines, forms, loops and state digests of conformance_drill.py)::

    oom_engines.py --out DIR --cells FORM:ENGINE[,...]

FSDP2 (and DDP) cells: at iteration 1 every rank's optimizer fails before touching anything; at iteration 3 rank
1's fails half-way through its update. DeepSpeed cells: at iteration 1 every rank's optimizer fails inside the
engine's step; vidstab stops the process there (:class:`vidstab.recovery.oom.OptimizerStateDiverged`); every rank failed
alike, so the script catches the stop and goes on with the next cell, except in the last cell, where the drill
strikes rank 1 alone (``oom_in_step@1:1``) and nothing is caught: the launch must end, not hang.

Each rank appends one line per iteration to ``FORM-ENGINE/trace-rank{R}.jsonl`` (what the guard decided and the
digests of the state before and after), or ``{"stopped": message}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conformance_drill as drill  # noqa: E402

from vidstab.faults import FaultInjector  # noqa: E402
from vidstab.recovery.oom import OptimizerStateDiverged  # noqa: E402

UNTOUCHED, PARTWAY, ITERATIONS = 1, 3, 6
LAST_FAULT = "oom_in_step@1:1"


def faults_for(engine: str, last: bool, world: int = 2) -> list[str]:
    if engine.startswith("zero"):
        return [LAST_FAULT] if last else [f"oom_in_step@{UNTOUCHED}"]
    return [f"oom_in_step@{UNTOUCHED}", f"oom_in_step@{PARTWAY}:{world - 1}=partway"]


def run_cell(form: str, engine: str, out: Path, last: bool) -> None:
    acc, model, opt, sched = drill.build(engine)
    rank, world = acc.process_index, acc.num_processes
    guard, ckpt, recovery, ema, counter = drill.cell_objects(acc, form, engine, model, opt, sched, out)
    FaultInjector(faults_for(engine, last, world), rank).arm_optimizer_step(opt, lambda: guard.global_step)
    state = lambda: drill.snapshot(engine, model, opt, sched, guard, counter, ema)  # noqa: E731
    global_step = 0
    with open(out / f"trace-rank{rank}.jsonl", "w") as trace:
        for i in range(ITERATIONS):
            x, y = drill.fault_batch(i, rank, world, faults=False)
            before = state()
            try:
                result = drill.form_step(form, acc, guard, model, opt, sched, F.mse_loss(model(x).float(), y), ema,
                                         counter)
            except OptimizerStateDiverged as e:
                trace.write(json.dumps({"i": i, "stopped": str(e)}) + "\n")
                if last:
                    raise
                guard.close()
                return
            # the explicit form's rollback target: one healthy checkpoint, after the first step
            count, global_step, target = drill.book_step(form, guard, recovery, ckpt, result, global_step,
                                                         lambda step: step == 1)
            trace.write(drill.trace_line(i, count, result, target, guard, before, state()))
            trace.flush()
    guard.close()


# ---- after the launch: the same assertions in every cell (tests/test_oom_engines.py, benchmarks/conformance.py) ----

def traces(cell: Path, world: int) -> dict[int, list[dict]]:
    return {r: drill._lines(cell / f"trace-rank{r}.jsonl") for r in range(world)}


def optimizer_ooms(cell: Path) -> list[tuple]:
    import vidstab

    return sorted((e["step"], e["rank"], e["touched"]) for e in vidstab.read_events(cell, "oom")
                  if e["phase"] == "optimizer")


def evaluate(cell: Path, form: str, engine: str, world: int) -> dict:
    """DDP, FSDP2, one process: an OOM before any update on every rank is skipped with the state bitwise unchanged;
    one after part of the last rank's update rolls every rank back to its checkpoint bitwise, the LR kept ("pass").
    DeepSpeed: every rank stops with a message saying what to do ("stopped"). Else "fail" with why."""
    got = traces(cell, world)
    if engine.startswith("zero"):
        stage = engine[-1]
        for rank, trace in got.items():
            said = f"vidstab: step 1, rank {rank}: out of memory inside DeepSpeed's engine.step() (ZeRO-{stage})"
            if [x.get("i") for x in trace] != [0, 1] or not trace[0].get("applied") \
                    or not trace[1].get("stopped", "").startswith(said) \
                    or "Resume from your last checkpoint (accelerate launch --max_restarts" not in trace[1]["stopped"]:
                return {"status": "fail", "why": f"rank {rank}: not stopped at iteration 1 with the message: {trace}"}
        if optimizer_ooms(cell) != [(1, r, None) for r in range(world)]:
            return {"status": "fail", "why": f"optimizer OOM events {optimizer_ooms(cell)}"}
        return {"status": "stopped", "why": f"out of memory inside DeepSpeed's engine.step() (ZeRO-{stage}): every "
                                            "rank stops with that message and what to do (resume under --max_restarts)"}
    why = drill._skipped_unchanged(got, UNTOUCHED, "oom")
    if why:
        return {"status": "fail", "why": why}
    if any(x["rollback"] for t in got.values() for x in t[:PARTWAY]):
        return {"status": "fail", "why": "a rollback before the partial update"}
    want = sorted([(UNTOUCHED, r, False) for r in range(world)] + [(PARTWAY, world - 1, True)])
    if optimizer_ooms(cell) != want:
        return {"status": "fail", "why": f"optimizer OOM events {optimizer_ooms(cell)}, not {want}"}
    judged = PARTWAY + 1
    import vidstab

    for rank, trace in got.items():
        if not (trace[judged]["rollback"] and "oom" in trace[judged]["detectors"]):
            return {"status": "fail", "why": f"rank {rank}: no rollback after the partial update: {trace[judged]}"}
        saved = {0: trace[0]["before"]}
        for x in trace[:judged]:
            saved.setdefault(x["count"], x["after"])
        if form == "explicit":
            target = trace[judged]["target"]
        else:
            events = [e for e in vidstab.read_events(cell, "rollback") if e["rank"] == rank]
            if len(events) != 1 or events[0]["cause"] != "exception" or events[0]["lr_multiplier"] != 1.0:
                return {"status": "fail", "why": f"rank {rank}: rollback events {events}"}
            target = int(events[0]["checkpoint"].rsplit("_", 1)[1])
        restored = trace[judged]["after"]
        if lost := drill._changed(saved[target], restored, ("weights", "optimizer")):
            return {"status": "fail", "why": f"rank {rank}: the rollback to {target} did not restore {lost}"}
        if trace[judged]["lr_multiplier"] != 1.0 or not trace[-1]["applied"] or not trace[-1]["after"]["finite"]:
            return {"status": "fail", "why": f"rank {rank}: the LR lowered, or the run did not go on finite"}
    return {"status": "pass"}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", required=True)
    args = ap.parse_args()
    cells = [tuple(c.split(":")) for c in args.cells.split(",")]
    for n, (form, engine) in enumerate(cells):
        out = Path(args.out, f"{form}-{engine}")
        out.mkdir(parents=True, exist_ok=True)
        run_cell(form, engine, out, last=n == len(cells) - 1 and engine.startswith("zero"))


if __name__ == "__main__":
    main()
