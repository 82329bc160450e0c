"""The conformance drill: the same faults, the same records, in every form x engine cell (benchmarks/conformance.py,
tests/test_conformance.py). Run with torchrun (2 or more processes) or plainly (one process)::

    conformance_drill.py --out DIR --cells FORM:ENGINE[,...] --launch faults|kill

FORM: ``attached`` (``vidstab.attach(..., rollback_every=N)`` on the user's own loop) or ``explicit``
(``guard.backward``/``guard.step`` with ``CheckpointManager`` + ``Recovery``). ENGINE: ``single`` (one process),
``ddp``, ``fsdp2`` (``fully_shard`` on a gloo CPU mesh, the model left out of ``prepare``), ``zero1``/``zero2``/
``zero3`` (DeepSpeed through Accelerate, fp32). Cells run one after the other in the launch, each in DIR/FORM-ENGINE.

``--launch faults``: one schedule of faults over the loop's iterations (:data:`SCHEDULE`): a NaN sample on the last
rank, a gradient spike (the loss x1e3 on every rank), an LR x1e4 bug for 3 steps, then the LR bug for good until
vidstab ends the cell (``RunAborted``; the last cell's is not caught, so the launch exits with vidstab's code).
Beside the weights the script keeps an EMA (saved and loaded by its own save/load-state hooks in the attached
form, registered with the ``CheckpointManager`` in the explicit one: each form's documented way) and a counter of
its own (``register_for_checkpointing`` / ``ckpt.register``). Each rank appends one line per iteration to
``trace-rank{R}.jsonl``: what the guard decided and a digest of each piece of state before and after the step.

``--launch kill``: under ``torchrun --max_restarts`` (torch elastic restarts every rank after the kill), the first
attempt trains and checkpoints every cell to :data:`KILL_AT` (the form's own checkpoints) and SIGKILLs the last rank
there in the last cell; the next attempt resumes every cell once (the form's own resume: ``accelerator.load_state``
of the script's newest ``checkpoint-N`` in the attached form, ``recovery.resume`` in the explicit one) and trains it
to :data:`KILL_TOTAL` steps. One restart serves every cell; markers in each cell's folder say where the launch
stands (a resume that crashes is that cell's result: the restart after it goes on with the next cell).
``kill-rank{R}.jsonl``: the digests saved and those resumed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vidstab  # noqa: E402
from ds_common import user_step  # noqa: E402  (the attached form's loop body as users write it)
from vidstab.checkpoint import CheckpointError  # noqa: E402

NAN, SPIKE, LR_BUG, PERSISTENT = 2, 6, (9, 10, 11), 16
SCHEDULE = {"nan": NAN, "spike": SPIKE, "lr_bug": list(LR_BUG), "persistent_from": PERSISTENT}
"""The loop iteration of each fault in the ``faults`` launch (iterations, not steps: the same in both forms)."""
ROLLBACK_EVERY = 4
MAX_ITERATIONS = 60  # the persistent fault ends the cell long before
KILL_AT, KILL_TOTAL, SAVE_EVERY = 7, 9, 3
# health_window: a 30-step drill has its healthy checkpoint a few steps after the last fault (the default is 50)
CONFIG = {"grad_spike": {"warmup_steps": 3, "ratio_warmup_steps": 3}, "param_norm_every": 1, "health_window": 3}
# Rollbacks from a copy in host memory where the engine's checkpoints allow it (DeepSpeed's roll back from files).
ROLLBACK_MEMORY_BUDGET = 64 << 20
FROM_FILES_LINE = "restores from the checkpoint's files, not from host memory: deepspeed checkpoints roll back"


class Counter:
    """The script's own state (e.g. samples seen), checkpointed with the run."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, d: dict) -> None:
        self.value = int(d["value"])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP2 DTensor's shard, a ZeRO-3 parameter's partition, else itself."""
    if hasattr(t, "to_local"):
        return t.to_local()
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    return t


def held(p: torch.Tensor) -> torch.Tensor:
    """What an EMA of ``p`` holds: the parameter (an FSDP2 DTensor stays one), a ZeRO-3 rank its partition."""
    return p.ds_tensor if hasattr(p, "ds_tensor") else p


class EMA:
    """An EMA of the weights, diffusers' ``EMAModel`` shape (``shadow_params``, ``step``)."""

    def __init__(self, params) -> None:
        self.shadow_params = [held(p).detach().clone().float() for p in params]
        self.optimization_step = 0

    @torch.no_grad()
    def step(self, params) -> None:
        self.optimization_step += 1
        for s, p in zip(self.shadow_params, params):
            s.mul_(0.9).add_(held(p).detach().float(), alpha=0.1)

    def local_state(self) -> dict:
        """This rank's part, as the script's own hooks save it (one file per rank)."""
        return {k: local(v) if torch.is_tensor(v) else v for k, v in self.state_dict().items()}

    def state_dict(self) -> dict:
        return {"optimization_step": self.optimization_step,
                **{f"shadow.{i}": s.clone() for i, s in enumerate(self.shadow_params)}}

    def load_state_dict(self, d: dict) -> None:
        self.optimization_step = int(d["optimization_step"])
        for i, s in enumerate(self.shadow_params):
            local(s).copy_(local(d[f"shadow.{i}"]))


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def build(engine: str):
    """(accelerator, model, optimizer, lr_scheduler): the same tiny MLP, AdamW and LambdaLR on every engine."""
    reset_accelerate()
    if engine.startswith("zero"):
        from ds_common import build as ds_build  # noqa: I001

        acc, model, opt, sched, _ = ds_build(int(engine[-1]), "no", 1, hidden=33)
        return acc, model, opt, sched
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.SiLU(), torch.nn.Linear(33, 4))
    if engine == "fsdp2":  # Accelerate refuses FSDP on CPU: shard by hand, leave the model out of prepare
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (acc.num_processes,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    if engine == "fsdp2":
        opt, sched = acc.prepare(opt, sched)
    else:
        model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def digest(tensors) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def snapshot(engine: str, model, opt, sched, guard, counter: Counter, ema: EMA) -> dict:
    """A digest of each piece of state a step can change, on this rank (the ZeRO partitions without padding)."""
    if engine.startswith("zero"):
        from vidstab.engines.deepspeed_support import ZeroPartitions

        parts = ZeroPartitions(model)
        tensors, _ = parts.state()
        weights = [(f"fp32.{i}", t) for i, t in enumerate(parts.real())]
        moments = sorted((k, v) for k, v in tensors.items() if not k.startswith("fp32."))
    else:
        weights = [(n, local(p)) for n, p in model.named_parameters()]
        moments = []
        for i, p in enumerate(model.parameters()):
            for k, v in sorted(opt.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    moments.append((f"{i}.{k}", local(v)))
    return {"weights": digest(weights), "optimizer": digest(moments),
            "scheduler": json.dumps({k: v for k, v in sched.state_dict().items() if k == "last_epoch"}),
            "guard_detectors": hashlib.sha256(json.dumps(guard.state_dict()["detectors"], sort_keys=True,
                                                         default=str).encode()).hexdigest()[:16],
            "user": counter.value, "ema": digest([(str(i), local(t)) for i, t in enumerate(ema.shadow_params)]),
            "ema_steps": ema.optimization_step,
            "finite": all(bool(torch.isfinite(t).all()) for _, t in weights)}


def fault_batch(i: int, rank: int, world: int, faults: bool):
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(4, 8, generator=g)
    y = x[:, :4] * 2 - 1
    if faults and i == NAN and rank == world - 1:
        x[1, 0] = float("nan")
    return x, y


def write_bad_lr(opt, sched) -> None:
    for group, lr in zip(opt.param_groups, sched.get_last_lr()):
        group["lr"] = lr * 1e4


def cell_objects(acc, form: str, engine: str, model, opt, sched, out: Path, resume: bool = False):
    """The guard (and the explicit form's checkpoint manager and recovery), the EMA and counter, each in the form's
    own way of checkpointing the script's state."""
    rank = acc.process_index
    params = list(model.parameters())
    ema, counter = EMA(params), Counter()
    vidstab.claim_run_dir(acc, out, resume="latest" if resume else None)
    config = vidstab.GuardConfig.from_dict(CONFIG)
    if form == "attached":  # the script's own hooks carry its EMA, as a diffusers script does
        def save_ema(models, weights, folder):
            torch.save(ema.local_state(), os.path.join(folder, f"ema-rank{rank}.pt"))

        def load_ema(models, folder):
            ema.load_state_dict(torch.load(os.path.join(folder, f"ema-rank{rank}.pt")))

        acc.register_save_state_pre_hook(save_ema)
        acc.register_load_state_pre_hook(load_ema)
        acc.register_for_checkpointing(counter)
        guard = vidstab.attach(acc, model, opt, sched, config=config, run_dir=out, rollback_every=ROLLBACK_EVERY,
                               rollback_memory_budget_bytes=ROLLBACK_MEMORY_BUDGET)
        return guard, None, None, ema, counter
    guard = vidstab.attach(acc, model, opt, sched, config=config, run_dir=out)
    ckpt = vidstab.CheckpointManager(acc, str(out),
                                     vidstab.CheckpointConfig(rollback_memory_budget_bytes=ROLLBACK_MEMORY_BUDGET))
    for name, obj in {"model": model, "optimizer": opt, "lr_scheduler": sched, "vidstab": guard,
                      "counter": counter}.items():
        ckpt.register(name, obj)
    try:
        ckpt.register("ema", ema)
    except CheckpointError as e:  # refused: the drill records why and goes on without it
        (out / "refused.json").write_text(json.dumps({"ema": str(e)}))
    return guard, ckpt, vidstab.Recovery(acc, ckpt, guard), ema, counter


def form_step(form: str, acc, guard, model, opt, sched, loss, ema: EMA, counter: Counter):
    """One optimizer step as each form's loop writes it, the EMA's and the counter's included; the guard's result."""
    if form == "attached":
        result = user_step(acc, model, opt, sched, loss)
        ema.step(model.parameters())  # vidstab holds it after a skipped step
    else:
        guard.backward(loss)
        result = guard.step(1.0)
        if result.applied:  # the explicit form's loop steps its EMA on an applied update only
            ema.step(model.parameters())
    if result.applied:
        counter.value += 1
    return result


def book_step(form: str, guard, recovery, ckpt, result, global_step: int, save_due) -> tuple[int, int, int | None]:
    """After one step: the explicit form's rollback or checkpoint save (``save_due(step)``), as its loop does.
    Returns (the step count now, the explicit loop's counter, the rollback's target step or None)."""
    if form == "attached":
        return guard.global_step, global_step, None
    rolled = recovery.after_step(result, global_step + 1)
    if rolled is not None:
        target = int(rolled["step"])
        return target, target, target
    global_step += 1
    if save_due(global_step):
        ckpt.save(global_step, healthy=guard.healthy, trainer_state={"step": global_step})
        ckpt.wait()
    return global_step, global_step, None


def trace_line(i: int, count: int, result, target: int | None, guard, before: dict, after: dict) -> str:
    """One iteration's record: what the guard decided, the state's digests before and after."""
    return json.dumps({"i": i, "count": count, "skipped": bool(result.skipped), "applied": bool(result.applied),
                       "rollback": result.rollback is not None, "target": target, "lr_multiplier": guard.lr_multiplier,
                       "detectors": sorted({f.detector for f in result.findings}), "before": before,
                       "after": after}) + "\n"


def faults_cell(form: str, engine: str, out: Path, last: bool) -> None:
    acc, model, opt, sched = build(engine)
    rank, world = acc.process_index, acc.num_processes
    guard, ckpt, recovery, ema, counter = cell_objects(acc, form, engine, model, opt, sched, out)
    trace = open(out / f"trace-rank{rank}.jsonl", "w")
    state = lambda: snapshot(engine, model, opt, sched, guard, counter, ema)  # noqa: E731
    global_step = 0  # the explicit form's loop counter (rolled back with the run)
    try:
        for i in range(MAX_ITERATIONS):
            if i in LR_BUG or i >= PERSISTENT:
                write_bad_lr(opt, sched)
            x, y = fault_batch(i, rank, world, faults=True)
            before = state()
            loss = F.mse_loss(model(x).float(), y) * (1e3 if i == SPIKE else 1.0)
            result = form_step(form, acc, guard, model, opt, sched, loss, ema, counter)
            count, global_step, target = book_step(form, guard, recovery, ckpt, result, global_step,
                                                   lambda step: step % ROLLBACK_EVERY == 0)
            trace.write(trace_line(i, count, result, target, guard, before, state()))
            trace.flush()
    except vidstab.RunAborted as e:
        trace.write(json.dumps({"aborted": str(e).splitlines()[0], "code": getattr(e, "code", None),
                                "type": type(e).__name__}) + "\n")
        trace.close()
        if last:
            raise
        return
    finally:
        if not trace.closed:
            trace.close()
    guard.close()


def kill_cell(form: str, engine: str, out: Path, resume: bool, kill: bool = False) -> None:
    """Fresh: train and checkpoint (the form's own way) to KILL_AT, where the last rank is SIGKILLed if ``kill``
    (its peers go on into a collective that never completes). Resume: to KILL_TOTAL."""
    acc, model, opt, sched = build(engine)
    rank, world = acc.process_index, acc.num_processes
    guard, ckpt, recovery, ema, counter = cell_objects(acc, form, engine, model, opt, sched, out, resume=resume)
    log = open(out / f"kill-rank{rank}.jsonl", "a")
    state = lambda: snapshot(engine, model, opt, sched, guard, counter, ema)  # noqa: E731
    step = 0
    if resume:
        if form == "attached":
            folders = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            acc.load_state(str(folders[-1]))
            step = int(folders[-1].name.split("-")[1])
        else:
            step = int(recovery.resume("latest")["step"])
        log.write(json.dumps({"resumed": step, "state": state()}) + "\n")
    while step < (KILL_TOTAL if resume else MAX_ITERATIONS if kill else KILL_AT):
        if kill and step == KILL_AT and rank == world - 1:
            log.close()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = fault_batch(step, rank, world, faults=False)
        loss = F.mse_loss(model(x).float(), y)
        form_step(form, acc, guard, model, opt, sched, loss, ema, counter)
        step += 1
        if step % SAVE_EVERY == 0:
            if form == "attached":  # every rank: DeepSpeed saves on each
                acc.save_state(str(out / f"checkpoint-{step}"))
            else:
                ckpt.save(step, healthy=guard.healthy, trainer_state={"step": step})
                ckpt.wait()
            log.write(json.dumps({"saved": step, "state": state()}) + "\n")
            log.flush()
    if resume:
        log.write(json.dumps({"done": step, "state": state()}) + "\n")
    log.close()
    guard.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cells", required=True)
    ap.add_argument("--launch", choices=("faults", "kill"), required=True)
    args = ap.parse_args()
    cells = [tuple(c.split(":")) for c in args.cells.split(",")]
    if args.launch == "faults":
        for n, (form, engine) in enumerate(cells):
            out = Path(args.out, f"{form}-{engine}", "faults")
            out.mkdir(parents=True, exist_ok=True)
            faults_cell(form, engine, out, last=n == len(cells) - 1)
        return
    # The markers are written before the work, by the main process: a later attempt knows where the launch stands.
    folders = [Path(args.out, f"{form}-{engine}", "kill") for form, engine in cells]
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if not (folders[0] / "started").exists():  # the first attempt: the last cell's kill ends it
        for n, ((form, engine), out) in enumerate(zip(cells, folders)):
            out.mkdir(parents=True, exist_ok=True)
            barrier_marker(out / "started", rank0)
            kill_cell(form, engine, out, resume=False, kill=n == len(cells) - 1)
        return
    for (form, engine), out in zip(cells, folders):
        if (out / "started").exists() and not (out / "resume_tried").exists():
            barrier_marker(out / "resume_tried", rank0)
            kill_cell(form, engine, out, resume=True)


def barrier_marker(path: Path, rank0: bool) -> None:
    """Every rank reads the markers before the main process writes one (the ranks must agree on the plan)."""
    import time

    world = int(os.environ.get("WORLD_SIZE", "1"))
    seen = path.parent / f".{path.name}-seen-{os.environ.get('RANK', '0')}"
    seen.touch()
    while len(list(path.parent.glob(f".{path.name}-seen-*"))) < world:
        time.sleep(0.05)
    if rank0:
        path.touch()


# ---- after the launch: the same assertions in every cell (benchmarks/conformance.py, tests/test_conformance.py) ----

DRILLS = ("nan", "spike", "lr_bug", "persistent", "ema", "kill_resume")
MAX_RETRIES = 3  # RecoveryConfig's default: rollbacks of one incident before the abort
ABORT_EXIT_CODE = 3  # the attached form's documented exit code (docs/runbook.md)
STEP_STATE = ("weights", "optimizer")
ROLLBACK_STATE = ("weights", "optimizer", "guard_detectors", "user", "ema", "ema_steps")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _changed(a: dict, b: dict, keys) -> list[str]:
    return [k for k in keys if a[k] != b[k]]


def _skipped_unchanged(traces: dict, i: int, detector: str) -> str | None:
    """None when iteration ``i`` was skipped on every rank by ``detector`` with the weights, the optimizer state
    and the EMA bitwise unchanged; else what went wrong."""
    for rank, trace in traces.items():
        e = next((x for x in trace if x.get("i") == i), None)
        if e is None:
            return f"rank {rank}: no record of iteration {i}"
        if not e["skipped"] or detector not in e["detectors"]:
            return f"rank {rank}: iteration {i} not skipped by {detector} (skipped={e['skipped']}, {e['detectors']})"
        changed = _changed(e["before"], e["after"], (*STEP_STATE, "ema", "ema_steps", "user"))
        if changed:
            return f"rank {rank}: iteration {i} skipped but changed {changed}"
    return None


def evaluate_faults(cell: Path, form: str, world: int) -> dict[str, dict]:
    """One result per drill of the ``faults`` launch: ``{"status": "pass"|"fail", "why": ...}``."""
    traces = {r: _lines(cell / "faults" / f"trace-rank{r}.jsonl") for r in range(world)}
    if not all(traces.values()):
        why = "no trace: the cell did not run (see the launch's output)"
        return {d: {"status": "fail", "why": why} for d in ("nan", "spike", "lr_bug", "persistent", "ema")}
    out: dict[str, dict] = {}
    out["nan"] = _skipped_unchanged(traces, NAN, "nonfinite")
    out["spike"] = _skipped_unchanged(traces, SPIKE, "grad_spike")
    why = None
    for i in LR_BUG:
        why = why or _skipped_unchanged(traces, i, "lr_bound")
    for rank, trace in traces.items():
        if any(x.get("rollback") for x in trace if x.get("i", PERSISTENT) < PERSISTENT):
            why = why or f"rank {rank}: a rollback before the persistent fault"
        if any(x["lr_multiplier"] != 1.0 for x in trace if x.get("i", PERSISTENT) < PERSISTENT):
            why = why or f"rank {rank}: the LR was backed off before the persistent fault"
    out["lr_bug"] = why
    refused = refusals(cell / "faults")
    out["persistent"] = _persistent(cell, form, traces, skip=("ema", "ema_steps") if "ema" in refused else ())
    out["ema"] = _ema(traces)
    result = {d: {"status": "fail" if why else "pass", **({"why": why} if why else {})} for d, why in out.items()}
    for drill, why in refused.items():
        result[drill] = {"status": "refused", "why": why}
    return result


def refusals(folder: Path) -> dict[str, str]:
    """The drills the cell's setup was refused (a registration refused with its reason), by drill."""
    path = folder / "refused.json"
    return json.loads(path.read_text()) if path.exists() else {}


def rollback_sources(cell: Path, world: int) -> set[str | None]:
    """Where the ``faults`` launch's rollbacks of ``cell`` restored from (``memory`` or ``files``), every rank."""
    return {e.get("source") for r in range(world) for e in _lines(cell / "faults" / "vidstab" / f"events-rank{r}.jsonl")
            if e["kind"] == "rollback"}


def _rollback_targets(cell: Path, form: str, rank: int, trace: list[dict]) -> list[int]:
    if form == "explicit":
        return [x["target"] for x in trace if x.get("rollback") and x.get("target") is not None]
    events = _lines(cell / "faults" / "vidstab" / f"events-rank{rank}.jsonl")
    return [int(e["checkpoint"].rsplit("_", 1)[1]) for e in events if e["kind"] == "rollback"]


def _persistent(cell: Path, form: str, traces: dict, skip=()) -> str | None:
    for rank, trace in traces.items():
        end = trace[-1]
        if "aborted" not in end:
            return f"rank {rank}: the persistent fault did not end the run"
        if form == "attached" and end["code"] != ABORT_EXIT_CODE:
            return f"rank {rank}: ended with {end['type']} code {end['code']}, not exit code {ABORT_EXIT_CODE}"
        rolled = [x for x in trace if x.get("rollback")]
        multipliers = [x["lr_multiplier"] for x in rolled if x.get("target") is not None or form == "attached"]
        if multipliers != [0.5 ** (n + 1) for n in range(MAX_RETRIES)]:
            return f"rank {rank}: LR multipliers after the rollbacks {multipliers}, not halved each time"
        if form == "explicit":
            rolled = [x for x in rolled if x.get("target") is not None]
        if len(rolled) != MAX_RETRIES:
            return f"rank {rank}: {len(rolled)} rollbacks before the abort, not {MAX_RETRIES}"
        targets = _rollback_targets(cell, form, rank, trace)
        if len(targets) != len(rolled):
            return f"rank {rank}: {len(rolled)} rollbacks, {len(targets)} rollback targets"
        saved, entered = {}, {}
        for x in trace:  # the state at each step count the first time it was reached (before any rollback)
            if "count" in x:
                saved.setdefault(x["count"], x["after"])
                entered.setdefault(x["count"], x["before"])
        keys = [k for k in ROLLBACK_STATE + (("scheduler",) if form == "explicit" else ()) if k not in skip]
        for x, target in zip(rolled, targets):
            expected = dict(saved[target])
            if form == "attached":  # its checkpoint is taken inside optimizer.step(): before the loop's own code
                expected["user"] = entered[target]["user"]  # after it (the counter) ran for that step
            changed = _changed(expected, x["after"], keys)
            if changed:
                return f"rank {rank}: the rollback at iteration {x['i']} to step {target} did not restore {changed}"
    return None


def _ema(traces: dict) -> str | None:
    """The EMA takes no skipped step, and (with the persistent drill) goes back with the weights."""
    for rank, trace in traces.items():
        for x in trace:
            if "i" in x and x["skipped"] and x["before"]["ema_steps"] != x["after"]["ema_steps"] \
                    and not x["rollback"]:
                return f"rank {rank}: the EMA advanced on the skipped iteration {x['i']}"
            if "i" in x and not x["skipped"] and x["after"]["ema_steps"] != x["before"]["ema_steps"] + 1:
                return f"rank {rank}: the EMA did not take the applied iteration {x['i']}"
        if not any(x.get("rollback") for x in trace):
            return f"rank {rank}: no rollback: the EMA's rollback was not exercised"
    return None


def evaluate_kill(cell: Path, world: int) -> dict:
    result = _kill(cell, world)
    warned, refused = attach_warnings(cell / "kill"), resume_refusals(cell / "kill")
    if result["status"] == "fail" and warned and refused:  # said at attach, refused at the resume: never silent
        return {"status": "refused_resume", "why": f"said at attach: {warned[0]}; the resume: {refused[0]}"}
    if result["status"] == "fail" and warned:  # said at attach: not silent, still not a pass
        return {"status": "warned", "why": f"{result['why']}; said at attach: {warned[0]}"}
    return result


def resume_refusals(folder: Path) -> list[str]:
    """Why the script's own ``accelerator.load_state`` was refused (``stop`` events, reason ``resume_refused``)."""
    events = _lines(folder / "vidstab" / "events-rank0.jsonl")
    return [e["message"] for e in events if e["kind"] == "stop" and e.get("reason") == "resume_refused"]


def attach_warnings(folder: Path) -> list[str]:
    """What the attached form's setup warned of (``warn`` events of detector ``rollback_every``), main process."""
    events = _lines(folder / "vidstab" / "events-rank0.jsonl")
    return [e["message"] for e in events if e["kind"] == "warn" and e.get("detector") == "rollback_every"]


def _kill(cell: Path, world: int) -> dict:
    skip = ("ema", "ema_steps") if "ema" in refusals(cell / "kill") else ()
    for rank in range(world):
        log = _lines(cell / "kill" / f"kill-rank{rank}.jsonl")
        resumed = [i for i, x in enumerate(log) if "resumed" in x]
        if len(resumed) != 1:
            return {"status": "fail", "why": f"rank {rank}: resumed {len(resumed)} times, not once (a failed "
                                             "resume: the launch's log says why)"}
        before, after = log[:resumed[0]], log[resumed[0]:]
        saved = [x for x in before if "saved" in x]
        if not saved or saved[-1]["saved"] != after[0]["resumed"]:
            return {"status": "fail", "why": f"rank {rank}: resumed at {after[0]['resumed']}, last saved "
                                             f"{saved[-1]['saved'] if saved else None}"}
        changed = _changed(saved[-1]["state"], after[0]["state"],
                           [k for k in (*ROLLBACK_STATE, "scheduler") if k not in skip])
        if changed:
            return {"status": "fail", "why": f"rank {rank}: the resume did not restore {changed}"}
        done = after[-1]
        if done.get("done") != KILL_TOTAL or not done["state"]["finite"]:
            return {"status": "fail", "why": f"rank {rank}: the resumed run did not finish finite at {KILL_TOTAL}"}
    return {"status": "pass"}


def launch(cells: list[str], kind: str, out: Path, nproc: int, timeout: int = 900):
    """Run ``cells`` (``FORM:ENGINE``) of one world size in one launch (``kind``: faults or kill)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it would turn DeepSpeed off
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p))
    script = [__file__, "--out", str(out), "--cells", ",".join(cells), "--launch", kind]
    if kind == "faults" and nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        if kind == "kill":
            cmd += ["--max_restarts", str(2 * len(cells)), "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", f"127.0.0.1:{port}"]
        else:
            cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port)]
        cmd += script
    if str(repo / "tests") not in sys.path:
        sys.path.insert(0, str(repo / "tests"))
    from trainer_utils import warm_run  # noqa: E402  (the tests' pre-imported launches; fresh ones elsewhere)

    return warm_run(cmd, env=env, timeout=timeout)


if __name__ == "__main__":
    main()
