#!/usr/bin/env python
"""Chaos drill for checkpoints: SIGKILL a real training process at random moments, resume, repeat.

A small training script (``tests/scripts/ckpt_train.py``) saves a checkpoint every step, so most random
kills land in the middle of a save (temp folder half written, manifest missing, pointer not replaced...).
After each kill a fresh process resumes from ``latest``. The drill checks that

* every resume starts (it finds a complete, valid checkpoint) and never goes backwards,
* every run that reaches the end has final weights and per-step losses bitwise equal to an
  uninterrupted reference run,
* no pickled file (.pt/.bin/.pkl) and no stale ``.tmp-*`` folder is left behind after a clean finish.

    python scripts/chaos_checkpoint.py --kills 20            # ~1-2 minutes on 2 CPU cores

The last line of output is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "tests", "scripts", "ckpt_train.py")


def _cmd(out: str, a: argparse.Namespace, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, TRAIN, "--out", out, "--steps", str(a.steps), "--hidden", str(a.hidden),
            "--keep", str(a.keep), *(extra or [])]


def reference(out: str, a: argparse.Namespace) -> float:
    """Run uninterrupted; return seconds per step (after start-up)."""
    p = subprocess.Popen(_cmd(out, a), stdout=subprocess.PIPE, text=True)
    t0 = t1 = None
    for line in p.stdout:
        if line.startswith("start step"):
            t0 = time.monotonic()
        elif line.startswith(f"step {a.steps} "):
            t1 = time.monotonic()  # the last step's line, before the final save and the exit
    rc = p.wait()
    if rc != 0 or t0 is None or t1 is None:
        raise SystemExit(f"reference run failed (rc={rc})")
    return (t1 - t0) / a.steps


def compare(ref: str, run: str) -> tuple[bool, bool]:
    """(final weights equal, every logged loss equal) between two run folders."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(os.path.join(ref, "final.safetensors")), load_file(os.path.join(run, "final.safetensors"))
    weights = x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    lr, lx = (json.load(open(os.path.join(d, "losses.json"))) for d in (ref, run))
    return weights, all(lr[k] == v for k, v in lx.items())


def leftovers(run: str) -> list[str]:
    bad = []
    for root, dirs, files in os.walk(os.path.join(run, "vidstab", "checkpoints")):
        bad += [os.path.join(root, d) for d in dirs if d.startswith(".tmp-")]
        bad += [os.path.join(root, f) for f in files if f.endswith((".pt", ".bin", ".pkl", ".pickle"))]
    return bad


def chaos(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    work = a.workdir or tempfile.mkdtemp(prefix="vidstab-chaos-")
    os.makedirs(work, exist_ok=True)
    ref = a.reference or os.path.join(work, "reference")
    if not os.path.exists(os.path.join(ref, "final.safetensors")):
        per_step = reference(ref, a)
    else:
        per_step = a.step_seconds
    kills, resumes, runs_finished, failures, mid_save = 0, 0, 0, [], 0
    run_id = 0
    run = os.path.join(work, f"run{run_id}")
    last_start = 0
    while kills < a.kills or os.path.exists(run) and not os.path.exists(os.path.join(run, "final.safetensors")):
        extra = ["--async"] if rng.random() < 0.5 else []
        p = subprocess.Popen(_cmd(run, a, extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        start = None
        line = p.stdout.readline()
        while line and not line.startswith("start step"):  # libraries may print first (DeepSpeed's accelerator note)
            line = p.stdout.readline()
        if line.startswith("start step"):
            start = int(line.split()[-1])
        if start is None:
            p.kill()
            err = p.stderr.read()
            failures.append(f"{run}: resume failed: {line.strip()} {err[-2000:]}")
            break
        if start < last_start:
            failures.append(f"{run}: resumed at step {start}, earlier than the previous resume at {last_start}")
        last_start = start
        resumes += 1
        if kills < a.kills:
            # Uniform over the remaining run time: most of it is spent saving (one checkpoint per step).
            time.sleep(rng.uniform(0, max(per_step * (a.steps - start), 0.05)))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills += 1
        p.stdout.read()
        err = p.stderr.read()
        rc = p.wait()
        ck_dir = os.path.join(run, "vidstab", "checkpoints")
        if rc == -signal.SIGKILL and os.path.isdir(ck_dir) and any(n.startswith(".tmp-") for n in os.listdir(ck_dir)):
            mid_save += 1  # the kill left a half-written save behind (the next start removes it)
        if rc not in (0, -signal.SIGKILL):
            failures.append(f"{run}: exit code {rc}: {err[-2000:]}")
            break
        # A kill can land after the run wrote its results (while the interpreter exits): finished too.
        if rc == 0 or os.path.exists(os.path.join(run, "final.safetensors")):
            runs_finished += 1
            weights, losses = compare(ref, run)
            if not (weights and losses):
                failures.append(f"{run}: final weights equal={weights}, losses equal={losses}")
            if leftovers(run):
                failures.append(f"{run}: left behind {leftovers(run)}")
            if not a.keep_files:
                shutil.rmtree(run, ignore_errors=True)
            run_id += 1
            run, last_start = os.path.join(work, f"run{run_id}"), 0
    if not a.keep_files and not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return {"kills": kills, "kills_mid_save": mid_save, "resumes": resumes, "runs_finished": runs_finished, "failures": failures,
            "ok": not failures and runs_finished >= 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs to deliver in total")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (one checkpoint per step)")
    p.add_argument("--hidden", type=int, default=512, help="model width (bigger -> longer saves)")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--reference", default=None, help="folder of an existing uninterrupted run (same steps/hidden)")
    p.add_argument("--step-seconds", type=float, default=0.05, help="seconds per step when --reference is given")
    p.add_argument("--keep-files", action="store_true")
    a = p.parse_args(argv)
    res = chaos(a)
    for f in res["failures"]:
        print("FAIL:", f)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
