"""Time lost per fault, with vidstab and with the same fault and no vidstab: ``bench_chaos.py --resilience``.

Every row launches the reference trainer on 2 CPU processes the way README's "Launching a run that survives
faults" says (``accelerate launch --rdzv_backend c10d --max_restarts 2``, a fresh store per round) and injects
one fault on rank 1 at step ``F`` (``vidstab.faults``):

- ``kill``: SIGKILL. vidstab: torch elastic restarts the group, the trainer resumes from the latest checkpoint.
  Without vidstab (``--no_vidstab --watchdog_timeout 0 --no_auto_resume``) the same launcher restarts the
  group and the script starts over from step 0.
- ``hang``: the rank blocks forever. vidstab: the watchdog ends it after ``--watchdog_timeout`` (the floor;
  the steps here are far shorter), then as for ``kill``. Without vidstab the job sits in a collective until
  the backend's timeout (gloo 30 min, NCCL 10 min by default); we stop waiting after ``hang_cap_s`` and
  report that as a lower bound.
- ``nan``: one NaN micro-batch. vidstab skips the step. Without vidstab the NaN reaches the weights; the run
  "finishes" with non-finite weights and everything after the last finite checkpoint is lost.

Time lost is read from the run's own event log, the same way on both sides, so the load of a shared machine
cancels out rather than adding two noisy wall times: with ``C`` the last checkpoint before the fault and
``C + k`` the next one, time lost = (time of checkpoint ``C + k``'s last save - time of checkpoint ``C``'s
first save) - (time of checkpoint ``C`` - time of checkpoint ``C - k``), i.e. how much longer the run took
to get from ``C`` to ``C + k`` than a healthy stretch of ``k`` steps of the same run; detection, restart,
start-up, resume and recomputation are all in it. A run that never reaches ``C + k`` counts up to the moment
we stopped waiting (a lower bound). After a NaN without vidstab the weights are non-finite: every step
after the last finite checkpoint is lost too, counted at the run's healthy step time. Wall times are printed
beside. The healthy rows also give the watchdog's cost:
median step time with the watchdog on and off (interleaved, ``ab_rounds`` each), and the cost of one
``Watchdog.beat`` call times the beats per step (4) against the median step.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vidstab.events import iter_event_file  # noqa: E402
from vidstab.run.watchdog import Watchdog, WatchdogConfig  # noqa: E402

BEATS_PER_STEP = 4  # data, forward_backward, guard, and the next step's data or a checkpoint (recipes/train.py)
PLAIN = ["--no_vidstab", "--watchdog_timeout", "0", "--no_auto_resume"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return [d for c in children for d in (c, *_descendants(c))]


def launch(out: Path, steps: int, ckpt: int, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--rdzv_backend", "c10d",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()), "--max_restarts", "2",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(REPO / "recipes" / "train.py"), "--output_dir", str(out), "--max_train_steps", str(steps),
           "--checkpointing_steps", str(ckpt), "--report_to", "none", "--num_videos", "16", "--train_batch_size", "4",
           "--hidden_size", "32", "--num_heads", "2", "--lr_warmup_steps", "2", "--no_async_save", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PET_STANDALONE": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.perf_counter()
    started_unix = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        # A hung job we stopped waiting for: torch elastic starts each worker in a session of its own, so
        # SIGKILL the workers by pid, then the launcher's group.
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, 9)
        rc, timed_out = proc.wait(), True
    return {"wall_s": round(time.perf_counter() - started, 2), "rc": rc, "timed_out": timed_out,
            "_started": started_unix, "_ended": time.time()}


def _events(out: Path, rank: int = 0) -> list[dict]:
    path = out / "vidstab" / f"events-rank{rank}.jsonl"
    return list(iter_event_file(path)) if path.exists() else []


def checkpoint_times(out: Path) -> list[tuple[int, float]]:
    """(step, time) of every checkpoint event of rank 0, in log order (a restarted run saves some steps twice)."""
    return [(e["step"], e["time"]) for e in _events(out) if e.get("kind") == "checkpoint"]


def time_lost(out: Path, fault_step: int, ckpt: int, ended: float) -> tuple[float, bool, float]:
    """(seconds lost between checkpoints C and C + k against a healthy stretch, lower bound?, healthy step time)."""
    c = fault_step - fault_step % ckpt
    saves = checkpoint_times(out)
    first_c = next(t for s, t in saves if s == c)
    before = next(t for s, t in saves if s == c - ckpt)
    healthy_span = first_c - before
    after = [t for s, t in saves if s == c + ckpt]
    end, bound = (after[-1], False) if after else (ended, True)
    return end - first_c - healthy_span, bound, healthy_span / ckpt


def median_step_s(out: Path) -> float:
    times = [e["time"] for e in _events(out) if e.get("kind") == "metrics"]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    return statistics.median(gaps) if gaps else float("nan")


def final_finite(out: Path, steps: int) -> bool | None:
    path = out / "vidstab" / "checkpoints" / f"step_{steps:06d}" / "model.safetensors"
    if not path.is_file():
        return None
    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values())


def last_finite_checkpoint(out: Path) -> int:
    best = 0
    for folder in sorted((out / "vidstab" / "checkpoints").glob("step_*")):
        path = folder / "model.safetensors"
        if path.is_file() and all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values()):
            best = max(best, int(folder.name.split("_")[1]))
    return best


def beat_cost_s(calls: int = 200_000) -> float:
    wd = Watchdog(Path("/nonexistent"), config=WatchdogConfig())  # never started: beat() alone
    phases = ("data", "forward_backward", "guard", "data")
    started = time.perf_counter()
    for i in range(calls):
        wd.beat(i // 4, phases[i % 4])
    return (time.perf_counter() - started) / calls


def in_process_ab(rounds: int = 150, warmup: int = 5) -> dict:
    """Median guarded step with and without the watchdog (thread running, 4 beats a step), interleaved, one process.

    The same model trained by both arms alternately (round-robin, rotating order), as in
    ``bench_guard_overhead.py``: neighbouring steps share the machine's load, which a comparison of whole
    launches on a shared machine does not.
    """
    import tempfile

    from accelerate import Accelerator

    import vidstab
    from vidstab.reference.model import VideoDiT

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    run_dir = Path(tempfile.mkdtemp(prefix="vidstab-watchdog-bench-"))
    torch.manual_seed(0)
    model = VideoDiT(in_channels=4, hidden_size=96, num_layers=4, num_heads=4, patch_size=(1, 2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    guard = vidstab.attach(accelerator, model, opt, sched, run_dir=run_dir)
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 4, 16, 16)
    batches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randint(0, 1000, (2,), generator=g))
               for _ in range(8)]
    watchdog = Watchdog(run_dir, config=WatchdogConfig(timeout_s=600)).start()

    def step(i: int, beat) -> None:
        x, noise, t = batches[i % len(batches)]
        beat(i, "data")
        with accelerator.accumulate(model):
            beat(i, "forward_backward")
            loss = torch.nn.functional.mse_loss(model(x + noise, t).float(), noise)
            guard.backward(loss, batch={"latents": x}, sample_ids=None)
            beat(i, "guard")
            guard.step(max_grad_norm=1.0)

    arms = {"watchdog_off": lambda i, phase: None, "watchdog_on": watchdog.beat}
    times = {name: [] for name in arms}
    for i in range(warmup):
        for beat in arms.values():
            step(i, beat)
    names = list(arms)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            started = time.perf_counter()
            step(r, arms[name])
            times[name].append(time.perf_counter() - started)
    watchdog.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rounds": rounds, "median_step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
            "ratio_on_over_off": round(med["watchdog_on"] / med["watchdog_off"], 4)}


def run(work: Path, steps: int = 30, ckpt: int = 5, fault_step: int = 17, watchdog_floor_s: float = 10.0,
        hang_cap_s: float = 120.0, ab_rounds: int = 1, timeout: float = 600.0, slowdown: float = 1.0) -> dict:
    """All rows; returns the summary dict (printed by bench_chaos.py)."""
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # `slowdown` > 1: every step of every rank that many times longer (vidstab.faults `slow`, kept across
    # restarts), to stand in for a real model whose recomputation is not free next to a launch's start-up.
    slow = ["--inject_fault", f"slow@0={slowdown:g}"] if slowdown > 1 else []
    wd = ["--watchdog_timeout", str(watchdog_floor_s), *slow]
    plain = [*PLAIN, *slow]
    f = f"{fault_step}:1"

    healthy = {"vidstab": [], "vidstab_no_watchdog": []}
    steps_s = {"vidstab": [], "vidstab_no_watchdog": []}
    for i in range(ab_rounds):  # interleaved, so load drift hits both alike
        for name, extra in (("vidstab", wd), ("vidstab_no_watchdog", ["--watchdog_timeout", "0", *slow])):
            out = work / f"healthy-{name}-{i}"
            healthy[name].append(launch(out, steps, ckpt, extra, timeout))
            steps_s[name].append(median_step_s(out))
    plain_healthy = launch(work / "healthy-plain", steps, ckpt, plain, timeout)
    base = {"vidstab": statistics.median(r["wall_s"] for r in healthy["vidstab"]), "plain": plain_healthy["wall_s"]}

    rows = []
    for fault, spec in (("kill", f"kill@{f}"), ("hang", f"hang@{f}"), ("nan", f"nan_batch@{f}")):
        for side, extra in (("vidstab", wd), ("plain", plain)):
            out = work / f"{fault}-{side}"
            cap = hang_cap_s if (fault == "hang" and side == "plain") else timeout
            res = launch(out, steps, ckpt, [*extra, "--inject_fault", spec], cap)
            restarts = [e for e in _events(out) if e.get("kind") == "restart"]
            finite = final_finite(out, steps)
            lost, bound, step_s = time_lost(out, fault_step, ckpt, res.pop("_ended"))
            res.pop("_started")
            skips = sum(1 for e in _events(out) if e.get("kind") == "skip")
            row = {"fault": fault, "side": side, **res, "restarts": len(restarts),
                   "cause": restarts[0].get("cause") if restarts else None,
                   "resumed_at": restarts[0].get("step") if restarts else None,
                   "finished": res["rc"] == 0 and finite is not None, "final_weights_finite": finite,
                   "skipped_steps": skips, "time_lost_s": round(lost, 2), "time_lost_is_lower_bound": bound,
                   "wall_minus_healthy_wall_s": round(res["wall_s"] - base[side], 2)}
            if fault == "nan" and finite is False:
                # The run ran to the end, but every step after the last finite checkpoint has to be redone
                # (at the healthy step time: --no_vidstab logs no per-step metrics to time it by).
                good = last_finite_checkpoint(out)
                row["steps_lost"] = steps - good
                row["finished"] = False
                row["time_lost_s"] = round(row["time_lost_s"] + (steps - good) * step_s, 2)
                row["note"] = f"weights non-finite from step {fault_step}; last finite checkpoint step {good}"
            if res["timed_out"]:
                row["note"] = (f"still hung after {hang_cap_s:g} s when we stopped waiting; the backend's collective "
                               f"timeout (gloo 1800 s, NCCL 600 s) would end it, then the job starts over")
            rows.append(row)

    med = {k: statistics.median(v) for k, v in steps_s.items()}
    beat = beat_cost_s()
    ab = in_process_ab()
    return {
        "bench": "chaos_resilience", "steps": steps, "checkpointing_steps": ckpt, "fault_step": fault_step, "slowdown": slowdown,
        "watchdog_floor_s": watchdog_floor_s,
        "healthy_wall_s": {"vidstab": base["vidstab"], "plain": base["plain"],
                           "runs": {k: [r["wall_s"] for r in v] for k, v in healthy.items()}},
        "rows": rows,
        "watchdog_cost": {
            "median_step_s_watchdog_on": round(med["vidstab"], 5), "median_step_s_watchdog_off": round(med["vidstab_no_watchdog"], 5),
            "launch_step_time_ratio_on_over_off": round(med["vidstab"] / med["vidstab_no_watchdog"], 4),
            "in_process_ab": ab,
            "beat_cost_us": round(beat * 1e6, 3),
            "beats_share_of_step": round(BEATS_PER_STEP * beat / med["vidstab"], 6),
            "collectives_added": 0,
        },
    }


def print_table(summary: dict) -> None:
    print(f"== Time lost per fault (2 processes, {summary['steps']} steps, checkpoint every "
          f"{summary['checkpointing_steps']}, steps slowed {summary['slowdown']:g}x, fault on rank 1 at step "
          f"{summary['fault_step']}, watchdog floor "
          f"{summary['watchdog_floor_s']:g} s); healthy wall: vidstab {summary['healthy_wall_s']['vidstab']} s, "
          f"plain {summary['healthy_wall_s']['plain']} s ==")
    print(f"{'fault':6s} {'side':8s} {'finished':>8s} {'restarts':>8s} {'cause':>7s} {'resumed':>7s} {'wall s':>7s} {'lost s':>8s}  note")
    for r in summary["rows"]:
        lost = f"{'>=' if r['time_lost_is_lower_bound'] else ''}{r['time_lost_s']}"
        print(f"{r['fault']:6s} {r['side']:8s} {str(r['finished']):>8s} {r['restarts']:>8d} {str(r['cause']):>7s} "
              f"{str(r['resumed_at']):>7s} {r['wall_s']:>7.1f} {lost:>8s}  {r.get('note', '')}")
    c = summary["watchdog_cost"]
    ab = c["in_process_ab"]
    print(f"watchdog on a healthy run, interleaved in one process ({ab['rounds']} steps each): median step "
          f"{ab['median_step_ms']['watchdog_on']} ms on vs {ab['median_step_ms']['watchdog_off']} ms off "
          f"({ab['ratio_on_over_off']}x)")
    print(f"  whole launches (noisy on a shared machine): median step {c['median_step_s_watchdog_on'] * 1e3:.2f} ms on vs "
          f"{c['median_step_s_watchdog_off'] * 1e3:.2f} ms off ({c['launch_step_time_ratio_on_over_off']}x); one beat "
          f"{c['beat_cost_us']} us, {BEATS_PER_STEP} per step = {c['beats_share_of_step'] * 100:.4f}% of a step; "
          f"collectives added: {c['collectives_added']}")
