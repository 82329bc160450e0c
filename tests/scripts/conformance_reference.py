"""The reference trainer's rows of the conformance matrix (benchmarks/conformance.py, tests/test_conformance.py):
``recipes/train.py`` launched as users launch it, with the drill schedule of conformance_drill.py in its own
``--inject_fault`` grammar, judged from what it writes (event logs, checkpoint files, exit code): it exposes no
state digests, so the weights-and-optimizer-unchanged checks of the other rows are replaced by what files show.

Launches per engine (single, ddp, fsdp2 = ``--fsdp``, zero1/2/3 = ``accelerate launch --use_deepspeed``):

- ``faults``: NaN on the last rank, gradient spike, LR bug for 3 steps, an OOM inside the optimizer step (not under
  DeepSpeed: it stops the process there), the persistent LR fault to the abort (exit code 3); ``--use_ema`` but at
  ZeRO-3, where the trainer refuses it (``ema_refusal``: a launch that must stop at setup with its reason, there
  with a ``--max_grad_norm`` other than DeepSpeed's clip too: both said at once);
- ``kill``: SIGKILL of the last rank at step :data:`KILL_AT` under ``--max_restarts 1``, the restart resuming with
  ``--resume_from_checkpoint latest`` from the checkpoint of step :data:`RESUMED_AT`, to :data:`KILL_TOTAL` steps
  (and a NaN sample on the last rank at :data:`KILL_NAN` before it, whose bundle names a checkpoint; under FSDP2 a
  transient fault at :data:`KILL_FLAKY` too);
- ``oom`` (DeepSpeed only): an OOM in the last rank's forward at :data:`DS_FORWARD_OOM` (skipped in lockstep), then
  one inside the engine's step on every rank at :data:`DS_OOM_STEP`: a stop with a message.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import conformance_drill as drill  # noqa: E402
from trainer_utils import fast_flags, shared_run, warm_run  # noqa: E402  (the tests' tiny model and data)

REPO = Path(__file__).resolve().parents[2]
ENGINES = {"single": 1, "ddp": 2, "fsdp2": 2, "zero1": 2, "zero2": 2, "zero3": 2, "zero2-bf16": 2}
"""fp32 but ``zero2-bf16`` (DeepSpeed's bf16 optimizer: fp32 master weights beside bf16 ones, another engine path)."""
OOM_STEP = 13  # between the LR bug and the persistent fault
KILL_AT, SAVE_EVERY, KILL_TOTAL = 8, 3, 9
RESUMED_AT = KILL_AT - KILL_AT % SAVE_EVERY
KILL_NAN = SAVE_EVERY + 1  # a bad sample after the first checkpoint: its incident bundle replays on trained weights
KILL_FLAKY = KILL_NAN + 1  # FSDP2's: a transient fault, rerun with the NaN's on every rank (tests/test_conformance.py)
DS_FORWARD_OOM, DS_OOM_STEP, DS_OOM_STEPS = 1, 2, 4
REFUSED_CLIP = 0.5  # DeepSpeed's gradient_clipping is accelerate launch's default, 1.0


def faults(world: int, engine: str) -> list[str]:
    """The drill schedule (conformance_drill.SCHEDULE) as ``--inject_fault`` flags."""
    last = world - 1
    specs = [f"nan_batch@{drill.NAN}:{last}", f"grad_spike@{drill.SPIKE}=1e3",
             f"lr_bug@{drill.LR_BUG[0]}=1e4x{len(drill.LR_BUG)}", f"lr_base@{drill.PERSISTENT}=1e4"]
    if not engine.startswith("zero"):
        specs.append(f"oom_in_step@{OOM_STEP}")
    return [x for s in specs for x in ("--inject_fault", s)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(engine: str, out: Path, *flags: str, restarts: int = 0, html_report: bool = False) -> tuple[list[str], dict]:
    """(argv, env) of ``recipes/train.py`` on ``engine`` (docs/deepspeed.md's ``accelerate launch --use_deepspeed``
    for ZeRO, DeepSpeed with ``ACCELERATE_USE_CPU`` unset; docs/faults.md's restart form with ``restarts``)."""
    world = ENGINES[engine]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    train = str(REPO / "recipes" / "train.py")
    if world == 1 and not restarts:
        cmd = [sys.executable, train]
    elif world == 1:  # accelerate launch runs one process without torch elastic: torchrun's restarts directly
        env.update(ACCELERATE_USE_CPU="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PET_STANDALONE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{_port()}", "--max_restarts", str(restarts), train]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(world), "--num_machines", "1",
               "--dynamo_backend", "no", "--mixed_precision", "bf16" if engine.endswith("bf16") else "no"]
        if engine.startswith("zero"):
            cmd += ["--use_deepspeed", "--zero_stage", engine[4]]
        else:
            env["ACCELERATE_USE_CPU"] = "1"
            cmd += ["--multi_gpu"] if world > 1 else []
        if restarts:
            env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PET_STANDALONE="1")
            cmd += ["--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1", "--max_restarts", str(restarts)]
        cmd += ["--main_process_port", str(_port()), train]
    return cmd + ["--output_dir", str(out), *fast_flags(html_report), *(["--fsdp"] if engine == "fsdp2" else []),
                  *flags], env


def run(engine: str, out: Path, *flags: str, restarts: int = 0, timeout: int = 900,
        html_report: bool = False) -> subprocess.CompletedProcess:
    cmd, env = command(engine, out, *flags, restarts=restarts, html_report=html_report)
    out.mkdir(parents=True, exist_ok=True)
    proc = warm_run(cmd, env=env, cwd=REPO, timeout=timeout)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    return proc


def launch(engine: str, kind: str, folder: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """One launch of ``kind`` (faults, ema_refusal, kill, oom) for ``engine``, in ``folder/kind``."""
    world = ENGINES[engine]
    config = folder / "vidstab_config.json"  # YAML is a superset of JSON
    folder.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(drill.CONFIG))
    common = ["--vidstab_config", str(config)]
    if kind == "faults":
        ema = [] if engine == "zero3" else ["--use_ema"]
        return run(engine, folder / kind, *common, *ema, "--max_train_steps", "40", "--checkpointing_steps",
                   str(drill.ROLLBACK_EVERY), *faults(world, engine), timeout=timeout)
    if kind == "ema_refusal":  # with a clip other than DeepSpeed's: both refused at setup, at once
        return run(engine, folder / kind, *common, "--use_ema", "--max_grad_norm", str(REFUSED_CLIP),
                   "--max_train_steps", "2", timeout=timeout)
    if kind == "kill":
        ema = [] if engine == "zero3" else ["--use_ema"]
        ema += ["--inject_fault", f"flaky_activation@{KILL_FLAKY}:{world - 1}"] if engine == "fsdp2" else []
        return run(engine, folder / kind, *common, *ema, "--max_train_steps", str(KILL_TOTAL), "--checkpointing_steps",
                   str(SAVE_EVERY), "--resume_from_checkpoint", "latest", "--inject_fault",
                   f"nan_batch@{KILL_NAN}:{world - 1}", "--inject_fault", f"kill@{KILL_AT}:{world - 1}", restarts=1,
                   timeout=timeout, html_report=engine == "ddp")  # DDP's dashboard: tests/test_incident_e2e.py
    if kind == "oom":  # a forward OOM on the last rank first: the engine's own skip (tests/test_conformance.py)
        return run(engine, folder / kind, *common, "--max_train_steps", str(DS_OOM_STEPS), "--checkpointing_steps",
                   str(DS_OOM_STEPS), "--inject_fault", f"oom@{DS_FORWARD_OOM}:{world - 1}", "--inject_fault",
                   f"oom_in_step@{DS_OOM_STEP}", timeout=timeout)
    raise ValueError(kind)


def kinds(engine: str) -> list[str]:
    return ["faults", "kill"] + (["oom"] if engine.startswith("zero") else []) + (
        ["ema_refusal"] if engine == "zero3" else [])


def shared_row(where, engine: str) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """``engine``'s launches (every kind), once per test session however its readers are spread over the xdist
    workers (``trainer_utils.shared_run``; ``where``: pytest's ``tmp_path_factory``): the folder, and each launch's
    exit code and log as a ``CompletedProcess`` (its stdout; stderr empty)."""

    def build(folder: Path) -> None:
        for kind in kinds(engine):
            proc = launch(engine, kind, folder, timeout=600)
            (folder / f"{kind}.exit").write_text(str(proc.returncode))

    folder = shared_run(where, f"conformance-reference-{engine}", build)
    return folder, {kind: subprocess.CompletedProcess([kind], int((folder / f"{kind}.exit").read_text()),
                                                      (folder / f"{kind}.log").read_text(), "")
                    for kind in kinds(engine)}


# ---- judged from the files ----

def events(out: Path, rank: int) -> list[dict]:
    return drill._lines(out / "vidstab" / f"events-rank{rank}.jsonl")


def _status(why: str | None) -> dict:
    return {"status": "fail", "why": why} if why else {"status": "pass"}


def _skipped_on_every_rank(evs: dict, steps, detector: str) -> str | None:
    for rank, ev in evs.items():
        for step in steps:
            if not any(e["kind"] == "skip" and e["step"] == step and e["detector"] == detector for e in ev):
                return f"rank {rank}: step {step} not skipped by {detector}"
    return None


def _before_persistent(ev: list[dict]) -> list[dict]:
    """The events up to the first rollback request (the persistent fault's)."""
    end = next((i for i, e in enumerate(ev) if e["kind"] in ("rollback_request", "rollback")), len(ev))
    return ev[:end]


def evaluate_faults(out: Path, engine: str, proc: subprocess.CompletedProcess,
                    refusal: subprocess.CompletedProcess | None = None) -> dict[str, dict]:
    world = ENGINES[engine]
    evs = {r: events(out, r) for r in range(world)}
    crashed = crash(out, proc)
    if crashed or not all(evs.values()):
        why = crashed or f"no event log: the launch did not run (exit {proc.returncode}; see its log)"
        return {d: {"status": "fail", "why": why} for d in ("nan", "spike", "lr_bug", "persistent", "ema",
                                                             *(() if engine.startswith("zero") else ("oom_in_step",)))}
    row: dict[str, dict] = {}
    nan = [sorted(e["step"] for e in ev if e["kind"] == "skip" and e["detector"] == "nonfinite") for ev in evs.values()]
    row["nan"] = _status(None if all(s == [drill.NAN] for s in nan) else
                         f"non-finite skips per rank {nan}, not [{drill.NAN}] on every rank")
    row["spike"] = _status(_skipped_on_every_rank(evs, [drill.SPIKE], "grad_spike"))
    why = _skipped_on_every_rank(evs, drill.LR_BUG, "lr_bound")
    for rank, ev in evs.items():
        first = next((e for e in ev if e["kind"] == "rollback_request"), None)
        if first is not None and first["step"] < drill.PERSISTENT:
            why = why or f"rank {rank}: a rollback requested at step {first['step']}, before the persistent fault"
    row["lr_bug"] = _status(why)
    multipliers = [[e["lr_multiplier"] for e in ev if e["kind"] == "rollback"] for ev in evs.values()]
    stops = [[e.get("exit_code") for e in ev if e["kind"] == "stop"] for ev in evs.values()]
    want = [0.5 ** (n + 1) for n in range(drill.MAX_RETRIES)]
    ok = all(m == want for m in multipliers) and all(s == [drill.ABORT_EXIT_CODE] for s in stops)
    row["persistent"] = _status(None if ok and proc.returncode != 0 else
                                f"rollback LR multipliers {multipliers}, stop codes {stops}, exit {proc.returncode}")
    if refusal is not None:
        said = "--use_ema is not supported under DeepSpeed ZeRO-3"
        log = refusal.stdout + refusal.stderr
        row["ema"] = ({"status": "refused", "why": log[log.index(said):].splitlines()[0]}
                      if refusal.returncode != 0 and said in log else
                      {"status": "fail", "why": f"--use_ema at ZeRO-3 not refused (exit {refusal.returncode})"})
    else:
        row["ema"] = _status(ema_follows_the_weights(out, evs[0]))
    if not engine.startswith("zero"):
        row["oom_in_step"] = _status(_oom_skipped(evs))
    return row


def crash(out: Path, proc: subprocess.CompletedProcess) -> str | None:
    """The trainer's error when the launch ended in a crash (a ``crash`` event) before its last rank's first step,
    else None."""
    ev = events(out, 0)
    first = next((e for e in ev if e["kind"] in ("metrics", "crash")), None)
    if first is not None and first["kind"] == "crash":
        return f"the trainer crashed at step {first['step']} (exit {proc.returncode}): {first['error'][:160]}"
    return None


def _oom_skipped(evs: dict) -> str | None:
    """An OOM inside the optimizer step before any update, on every rank: skipped on every rank, no rollback."""
    for rank, ev in evs.items():
        ooms = [(e["step"], e["touched"]) for e in ev if e["kind"] == "oom" and e.get("phase") == "optimizer"]
        if ooms != [(OOM_STEP, False)]:
            return f"rank {rank}: optimizer OOMs (step, touched) {ooms}, not [({OOM_STEP}, False)]"
    why = _skipped_on_every_rank(evs, [OOM_STEP], "oom")
    if why:
        return why
    for rank, ev in evs.items():
        if any(e["kind"] == "rollback_request" and e["step"] < drill.PERSISTENT for e in ev):
            return f"rank {rank}: a rollback before the persistent fault"
    return None


def ema_follows_the_weights(out: Path, ev: list[dict]) -> str | None:
    """Every checkpoint's EMA (the last one's included) is finite and has taken exactly the applied steps of the
    trajectory that led to it: a skipped step would add one, an EMA not rolled back with the weights all the
    updates of the discarded attempts. Read from the files (the trajectory from rank 0's event log)."""

    steps, skipped, expected = set(), set(), {}
    for e in ev:
        if e["kind"] == "metrics":
            steps.add(e["step"])
        elif e["kind"] == "skip":
            skipped.add(e["step"])
        elif e["kind"] == "rollback":  # the trajectory goes back to the checkpoint's step
            steps = {s for s in steps if s < e["to_step"]}
            skipped = {s for s in skipped if s < e["to_step"]}
        elif e["kind"] == "checkpoint":
            expected[e["path"]] = len([s for s in steps if s < e["step"] and s not in skipped])
    kept = {path: applied for path, applied in expected.items() if (out / path).is_dir()}  # older ones pruned
    if not kept:
        return "no checkpoint kept"
    for path, applied in kept.items():
        folder = out / path
        state = json.loads((folder / "ema.json").read_text())
        if state["optimization_step"] != applied:
            return (f"{path}: the EMA took {state['optimization_step']} steps, the trajectory to it applied {applied} "
                    "(skipped steps taken, or not rolled back with the weights)")
        tensors = saved_weights(folder, "ema")
        if not tensors or not all(bool(t.isfinite().all()) for t in tensors):
            return f"{path}: the EMA is not finite (or not saved)"
    return None


def evaluate_kill(out: Path, engine: str, proc: subprocess.CompletedProcess) -> dict:
    """SIGKILL of the last rank at KILL_AT: one restart naming it, resumed from step RESUMED_AT, the steps it replays
    (RESUMED_AT .. KILL_AT - 1) bitwise the first attempt's (loss, gradient norm, LR: weights, optimizer state, data
    position, RNG and schedule restored), finished at KILL_TOTAL with exit 0 and finite weights (and EMA)."""
    world = ENGINES[engine]
    if proc.returncode != 0:
        return {"status": "fail", "why": crash(out, proc) or f"the launch exited {proc.returncode}"}
    for rank in range(world):
        ev = events(out, rank)
        starts = [i for i, e in enumerate(ev) if e["kind"] == "start"]  # one per attempt
        restarts = [e for e in ev if e["kind"] == "restart"]
        if len(starts) != 2 or len(restarts) != 1:
            return {"status": "fail", "why": f"rank {rank}: {len(starts)} attempts, {len(restarts)} restart events"}
        cut, r = starts[1], restarts[0]
        if rank == 0 and (r["cause"] != "killed" or r["culprit_ranks"] != [world - 1]):
            return {"status": "fail", "why": f"restart cause {r['cause']}, ranks {r['culprit_ranks']}"}
        if r["step"] != RESUMED_AT:
            return {"status": "fail", "why": f"rank {rank}: resumed at {r['step']}, not {RESUMED_AT}"}
        stops = [e.get("exit_code") for e in ev[cut:] if e["kind"] == "stop"]
        replayed = _replayed_bitwise(ev, cut) if rank == 0 < world - 1 else True
        if stops != [0] or replayed is not True:
            return {"status": "fail", "why": f"rank {rank}: stops {stops}; {replayed}"}
    saves = [e for e in events(out, 0) if e["kind"] == "checkpoint" and e["step"] == KILL_TOTAL]
    if not saves:
        return {"status": "fail", "why": f"no checkpoint of step {KILL_TOTAL}"}
    final = out / saves[-1]["path"]
    if not all(bool(t.isfinite().all()) for t in saved_weights(final)) or not saved_weights(final):
        return {"status": "fail", "why": f"{final.name}: weights or EMA not finite"}
    if world == 1:  # the main process is the one killed: its last events (the steps to compare) die with it
        return {"status": "pass", "why": "one process: resumed at the last checkpoint and finished finite; the killed "
                                         "process's unwritten events die with it, so the replayed steps are not compared"}
    return {"status": "pass"}


def saved_weights(folder: Path, prefix: str = "") -> list:
    """The full weights (``model.safetensors``; ``--fsdp``: the DCP shards) and EMA a checkpoint folder holds, or
    with ``prefix="ema"`` its EMA only (never the ZeRO partitions: their padding is uninitialised)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("ema*.safetensors")) + ([] if prefix else [folder / "model.safetensors"])
    return [t for f in files if f.exists() for t in load_file(str(f)).values()] + [
        t for f in sorted(folder.glob("dcp/*.safetensors")) for k, t in load_file(str(f)).items()
        if k.startswith(prefix + "." if prefix else ("model.", "ema."))]


def _replayed_bitwise(ev: list[dict], cut: int) -> bool | str:
    """True when the main process's metrics (the loss and gradient norm reduced over every rank, the LR) of the steps
    the resumed attempt replays equal the first attempt's bitwise and it ran to the end; else what differs."""
    first, second = ({e["step"]: (e["loss"], e["grad_norm"], e["lr"]) for e in part if e["kind"] == "metrics"}
                     for part in (ev[:cut], ev[cut:]))
    replayed = list(range(RESUMED_AT, KILL_AT))
    if [first.get(s) for s in replayed] != [second.get(s) for s in replayed] or not first or None in first.values():
        return (f"steps {replayed} after the resume differ from the first attempt's: "
                f"{[first.get(s) for s in replayed]} vs {[second.get(s) for s in replayed]}")
    return True if max(second, default=-1) == KILL_TOTAL - 1 else f"last step {max(second, default=None)}"


def evaluate_oom_stop(out: Path, engine: str, proc: subprocess.CompletedProcess) -> dict:
    """DeepSpeed updates inside its engine: an OOM there stops every rank with one message saying what to do."""
    world = ENGINES[engine]
    if crash(out, proc):  # crashed before the first step: not the drill's stop
        return {"status": "fail", "why": crash(out, proc)}
    log = proc.stdout + proc.stderr
    said = f"out of memory inside DeepSpeed's engine.step() (ZeRO-{engine[4]})"
    for rank in range(world):
        ooms = [e["step"] for e in events(out, rank) if e["kind"] == "oom" and e.get("phase") == "optimizer"]
        if ooms != [DS_OOM_STEP] or f"step {DS_OOM_STEP}, rank {rank}: {said}" not in log:
            return {"status": "fail", "why": f"rank {rank}: optimizer OOMs {ooms}, message said: "
                                             f"{f'step {DS_OOM_STEP}, rank {rank}: {said}' in log}"}
    if proc.returncode == 0:
        return {"status": "fail", "why": "the launch exited 0 after the OOM"}
    return {"status": "stopped", "why": f"{said}: the process stops with that message and what to do (resume under "
                                        "--max_restarts); no skip or rollback inside the engine's step"}
