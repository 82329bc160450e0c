#!/usr/bin/env python
"""Does a vidstab run survive being killed and having its checkpoints damaged, and end up bit-identical?

    python benchmarks/bench_chaos.py                       # 3 runs x 3 faults each
    python benchmarks/bench_chaos.py --runs 5 --kills 4
    python benchmarks/bench_chaos.py --quick               # 1 run x 2 faults, smoke test
    python benchmarks/bench_chaos.py --resilience          # time lost per hang / kill / NaN, vidstab vs none (chaos_resilience.py)

Each chaos run trains the reference trainer (``recipes/train.py``, tiny settings, async checkpoints) in
segments. Before each resumed segment one fault is applied, drawn from:

- ``sigkill_step``: SIGKILL at a random step while training;
- ``sigkill_save``: SIGKILL the moment a checkpoint write is in flight (a ``vidstab/checkpoints/.tmp-*`` entry exists);
- ``sigterm``: SIGTERM at a random step (the trainer should save and exit cleanly);
- ``truncate`` / ``bitflip``: damage a random file of the newest checkpoint on disk (between segments).

Then every damaged-state drill of ``tests/checkpoint_drills.py`` runs once (section "drills": passed,
failed, skipped; the same drills are tests in ``tests/test_checkpoint_safety.py``).

Every segment restarts with ``--resume_from_checkpoint latest``; the last one runs to the end. Counted:
runs resumed and finished; checkpoints lost (a checkpoint that was complete on disk -- valid manifest --
and that we did not damage, found missing or failing its manifest's sizes/checksums after a fault, or a
resume that started from an older checkpoint than the newest intact one); damaged checkpoints loaded
anyway; unrecoverable runs (the final segment does not finish), split into those that still had an
intact checkpoint and those whose every checkpoint had been damaged on purpose; and runs whose final weights
(``vidstab/checkpoints/step_XXXXXX/model.safetensors``) differ from an uninterrupted run's; steps of a finished run
without a ``metrics`` line in rank 0's event log (a kill must not lose the lines of steps a checkpoint covers).
The checker verifies
files itself from the manifests and never trusts the component under test.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "benchmarks" / ".cache" / "chaos"

PROCESS_FAULTS = ("sigkill_step", "sigkill_save", "sigterm")
DISK_FAULTS = ("truncate", "bitflip")
ALL_FAULTS = ("sigkill_step", "truncate", "sigkill_save", "bitflip", "sigterm")


@dataclass
class ChaosConfig:
    """One chaos campaign."""

    runs: int = 3
    """Independent chaos runs (each against the same uninterrupted reference)."""
    kills: int = 3
    """Faults per run (process kills and checkpoint damage), each followed by a resume."""
    steps: int = 40
    """``--max_train_steps`` of every run."""
    checkpointing_steps: int = 5
    """``--checkpointing_steps``."""
    seed: int = 0
    """Seed of the fault draws (which fault, at which step, which file); training seed is fixed at 0."""
    timeout: float = 600.0
    """Seconds a trainer segment may take before it is killed and counted as hung."""
    plan: tuple[str, ...] = ()
    """A fixed fault sequence instead of random draws (``--quick``: a kill, then damage to the newest checkpoint)."""
    min_kill_step: int = 1
    """Earliest step for ``sigkill_step``/``sigterm`` targets."""


def train_cmd(out: Path, cfg: ChaosConfig, resume: bool) -> list[str]:
    cmd = [sys.executable, str(REPO / "recipes" / "train.py"), "--output_dir", str(out),
           "--max_train_steps", str(cfg.steps), "--checkpointing_steps", str(cfg.checkpointing_steps),
           "--report_to", "none", "--num_videos", "16", "--train_batch_size", "4", "--hidden_size", "32",
           "--num_heads", "2"]
    return cmd + (["--resume_from_checkpoint", "latest"] if resume else [])


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ------------------------------------------------------------------------------------------------------
# Reading the run folder without trusting vidstab
# ------------------------------------------------------------------------------------------------------
def events(out: Path) -> list[dict]:
    """Event log lines that parse (a SIGKILL may leave a torn last line)."""
    path = out / "vidstab" / "events-rank0.jsonl"
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def last_step(out: Path) -> int:
    """Newest step with a metrics event (cheap tail read)."""
    path = out / "vidstab" / "events-rank0.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 8192))
            tail = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return -1
    for line in reversed(tail):
        if '"kind":"metrics"' in line.replace(" ", ""):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
    return -1


def verify(ckpt: Path) -> bool:
    """The folder's manifest parses and every file it lists has the listed size and checksum (crc32, the
    default, or sha256; checked here independently of vidstab's own verification)."""
    try:
        man = json.loads((ckpt / "manifest.json").read_text())
        for name, meta in man["files"].items():
            p = ckpt / name
            if p.stat().st_size != int(meta["bytes"]):
                return False
            if "crc32" not in meta and "sha256" not in meta:
                return False
            h, crc = hashlib.sha256(), 0
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    crc = zlib.crc32(block, crc)
            if "sha256" in meta and h.hexdigest() != meta["sha256"]:
                return False
            if "crc32" in meta and int(meta["crc32"], 16) != crc:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def complete_checkpoints(out: Path) -> dict[str, bool]:
    """step folder name -> verified, for every folder that has a manifest (i.e. claims to be complete)."""
    root = out / "vidstab" / "checkpoints"
    res = {}
    if not root.is_dir():
        return res
    for d in sorted(root.glob("step_*")):
        if (d / "manifest.json").exists():
            res[d.name] = verify(d)
    return res


def read_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def weights_equal(a: Path, b: Path) -> tuple[bool, float]:
    """Bitwise equality of two model.safetensors, and the largest absolute difference."""
    import torch

    wa, wb = read_weights(a), read_weights(b)
    if set(wa) != set(wb):
        return False, float("inf")
    worst = 0.0
    for k in wa:
        if wa[k].shape != wb[k].shape:
            return False, float("inf")
        worst = max(worst, float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].numel() else 0.0)
    return all(torch.equal(wa[k], wb[k]) for k in wa), worst


# ------------------------------------------------------------------------------------------------------
# Faults
# ------------------------------------------------------------------------------------------------------
def run_segment(out: Path, cfg: ChaosConfig, resume: bool, fault: str | None, rng: random.Random) -> dict:
    """Start the trainer, apply a process fault (or none), wait for it to exit."""
    start_step = last_step(out)
    log = open(out.parent / f"{out.name}.log", "a")
    proc = subprocess.Popen(train_cmd(out, cfg, resume), cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    info = {"fault": fault, "landed": False, "at_step": None, "rc": None}
    lo = min(max(start_step + 1, cfg.min_kill_step), cfg.steps - 1)
    target = rng.randint(lo, cfg.steps - 1) if fault in ("sigkill_step", "sigterm") else None
    deadline = time.time() + cfg.timeout
    ckroot = out / "vidstab" / "checkpoints"
    try:  # a killed save leaves its .tmp folder until the next manager starts: only new ones count
        stale = set(os.listdir(ckroot))
    except OSError:
        stale = set()
    try:
        while proc.poll() is None:
            if time.time() > deadline:
                proc.kill()
                info["hung"] = True
                break
            if fault == "sigkill_save":
                try:
                    inflight = [n for n in os.listdir(ckroot) if n.startswith(".tmp-step") and n not in stale]
                except OSError:
                    inflight = []
                if inflight:
                    proc.send_signal(signal.SIGKILL)
                    info.update(landed=True, at_step=last_step(out), inflight=inflight[0])
                    break
                time.sleep(0.002)
            elif target is not None:
                s = last_step(out)
                if s >= target:
                    proc.send_signal(signal.SIGKILL if fault == "sigkill_step" else signal.SIGTERM)
                    info.update(landed=True, at_step=s)
                    break
                time.sleep(0.01)
            else:
                time.sleep(0.05)
        info["rc"] = proc.wait(timeout=cfg.timeout)
        if fault == "sigterm" and info["landed"]:
            # the trainer should save the step it stopped at and exit 0
            info["clean_exit"] = info["rc"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return info


def damage(out: Path, kind: str, rng: random.Random) -> dict | None:
    """Truncate or flip one bit of a random file of the newest complete checkpoint."""
    done = [n for n, ok in complete_checkpoints(out).items() if ok]
    if not done:
        return None
    name = max(done)
    files = sorted(p for p in (out / "vidstab" / "checkpoints" / name).iterdir() if p.is_file() and p.stat().st_size > 0)
    victim = rng.choice(files)
    size = victim.stat().st_size
    if kind == "truncate":
        with open(victim, "r+b") as fh:
            fh.truncate(rng.randint(0, size - 1))
    else:
        pos = rng.randrange(size)
        with open(victim, "r+b") as fh:
            fh.seek(pos)
            b = fh.read(1)[0]
            fh.seek(pos)
            fh.write(bytes([b ^ (1 << rng.randrange(8))]))
    return {"checkpoint": name, "file": victim.name, "kind": kind}


@dataclass
class RunReport:
    """What happened to one chaos run."""

    faults: list = field(default_factory=list)
    resumes: int = 0
    resumed_from: list = field(default_factory=list)
    checkpoints_lost: int = 0
    lost_detail: list = field(default_factory=list)
    damaged_loaded: int = 0
    finished: bool = False
    final_rc: int | None = None
    identical: bool | None = None
    max_abs_diff: float | None = None
    intact_before_final: bool | None = None
    """Whether a complete, verifying checkpoint that the benchmark had not damaged existed when the last
    segment started (False: every checkpoint on disk had been damaged on purpose; no resume can use one)."""
    had_checkpoints: bool = False
    """Whether any checkpoint had been written before the last segment."""
    steps_without_metrics: list = field(default_factory=list)
    """Steps of a finished run (as logged, from 0) without a ``metrics`` line in rank 0's event log."""


def chaos_run(idx: int, cfg: ChaosConfig, reference: Path | None, workdir: Path) -> RunReport:
    rng = random.Random(cfg.seed * 1000 + idx)
    out = workdir / f"run{idx}"
    shutil.rmtree(out, ignore_errors=True)
    rep = RunReport()
    damaged: set[str] = set()
    resume = False
    for i in range(len(cfg.plan) if cfg.plan else cfg.kills):
        have_ckpt = any(complete_checkpoints(out).values())
        # Round-robin over all kinds across the campaign (every kind is exercised), damage only once a
        # checkpoint exists.
        kind = cfg.plan[i] if cfg.plan else ALL_FAULTS[(idx * cfg.kills + i) % len(ALL_FAULTS)]
        if kind in DISK_FAULTS and not have_ckpt:
            kind = "sigkill_step"
        if kind in DISK_FAULTS:
            d = damage(out, kind, rng)
            rep.faults.append(d or {"kind": kind, "skipped": "no checkpoint"})
            if d:
                damaged.add(d["checkpoint"])
            continue
        before = {n for n, ok in complete_checkpoints(out).items() if ok and n not in damaged}
        n_resume_before = sum(1 for e in events(out) if e.get("kind") == "resume")
        info = run_segment(out, cfg, resume, kind, rng)
        rep.faults.append(info)
        _audit(out, before, damaged, rep, n_resume_before)
        resume = True
    n_resume_before = sum(1 for e in events(out) if e.get("kind") == "resume")
    before = {n for n, ok in complete_checkpoints(out).items() if ok and n not in damaged}
    now = complete_checkpoints(out)
    rep.had_checkpoints = bool(now) or any("checkpoint" in f for f in rep.faults)
    rep.intact_before_final = any(ok and n not in damaged for n, ok in now.items())
    final = run_segment(out, cfg, resume, None, rng)
    _audit(out, before, damaged, rep, n_resume_before)
    rep.final_rc = final["rc"]
    final_ckpt = out / "vidstab" / "checkpoints" / f"step_{cfg.steps:06d}" / "model.safetensors"
    rep.finished = final["rc"] == 0 and final_ckpt.is_file() and verify(final_ckpt.parent)
    if rep.finished and reference is not None:
        rep.identical, rep.max_abs_diff = weights_equal(final_ckpt, reference)
    if rep.finished:  # the log is as durable as the checkpoints: no kill may leave a trained step unlogged
        logged = {e.get("step") for e in events(out) if e.get("kind") == "metrics"}
        rep.steps_without_metrics = sorted(set(range(cfg.steps)) - logged)
    return rep


def _audit(out: Path, before: set[str], damaged: set[str], rep: RunReport, n_resume_before: int) -> None:
    """After a segment: intact checkpoints that went bad or vanished (other than by rotation), and which
    checkpoint the resume used."""
    now = complete_checkpoints(out)
    newest_before = max(before) if before else None
    for name in before:
        gone = name not in now
        newer_valid = any(ok and n > name for n, ok in now.items())
        # Rotation may delete old checkpoints, and the newest one once a newer complete one exists; an
        # intact checkpoint that is still there must still verify.
        if (gone and name == newest_before and not newer_valid) or (not gone and not now[name]):
            rep.checkpoints_lost += 1
            rep.lost_detail.append({"checkpoint": name, "why": "missing" if gone else "fails manifest"})
    resumes = [e for e in events(out) if e.get("kind") == "resume"][n_resume_before:]
    for e in resumes:
        rep.resumes += 1
        used = _checkpoint_name(e.get("checkpoint"))
        rep.resumed_from.append(used)
        if used in damaged:
            rep.damaged_loaded += 1
        if newest_before and used and used < newest_before:
            rep.checkpoints_lost += 1
            rep.lost_detail.append({"checkpoint": newest_before, "why": f"resume used older {used}"})


def _checkpoint_name(field_value) -> str:
    """Folder name of the checkpoint a ``resume`` event names (a path, or the loader's info dict/its repr)."""
    import re

    if isinstance(field_value, dict):
        field_value = field_value.get("path", "")
    text = str(field_value or "")
    m = re.search(r"'path':\s*'([^']*)'", text)
    if m:
        text = m.group(1)
    m = re.search(r"step_\d+", Path(text).name) or re.search(r"step_\d+", text)
    return m.group(0) if m else ""


# ------------------------------------------------------------------------------------------------------
# Damaged-state drills (tests/checkpoint_drills.py): counted here, each also a test in tests/
# ------------------------------------------------------------------------------------------------------
def run_checkpoint_drills(workdir: Path) -> dict:
    """Run every checkpoint drill of ``tests/checkpoint_drills.py`` (manifest names outside the folder,
    links, FIFOs, devices, unreadable pointers/manifests, the clock stepped back, an unremovable damaged
    checkpoint, another world size, no such checkpoint, Accelerate/diffusers coexistence, classic damage)
    in-process against real files; print one row each and return the counts. A drill has no baseline: it
    states what vidstab must do and passes or fails."""
    import logging

    sys.path.insert(0, str(REPO / "tests"))
    from checkpoint_drills import DRILLS, run_drill

    shutil.rmtree(workdir, ignore_errors=True)
    quiet = logging.NullHandler()  # the drills' expected warnings stay out of the table (drills still see them)
    logging.getLogger("vidstab.checkpoint").addHandler(quiet)
    started = time.time()
    try:
        rows = [run_drill(name, workdir / name) for name in DRILLS]
    finally:
        logging.getLogger("vidstab.checkpoint").removeHandler(quiet)
    print(f"== Checkpoint drills: {len(rows)} (tests/checkpoint_drills.py), {time.time() - started:.0f} s ==")
    for r in rows:
        verdict = "skipped" if r["ok"] is None else ("pass" if r["ok"] else "FAIL")
        print(f"{r['drill']:34s} {verdict:7s} {r['detail'][:110]}")
    return {"total": len(rows), "passed": sum(r["ok"] is True for r in rows),
            "failed": sum(r["ok"] is False for r in rows), "skipped": sum(r["ok"] is None for r in rows),
            "failed_names": [r["drill"] for r in rows if r["ok"] is False], "seconds": round(time.time() - started, 1),
            "details": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpointing-steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 run x 2 faults, 24 steps (smoke test).")
    ap.add_argument("--workdir", type=str, default=str(CACHE))
    ap.add_argument("--resilience", action="store_true",
                    help="Instead: time lost per hang, kill and NaN on 2 processes, with vidstab and without (chaos_resilience.py).")
    args = ap.parse_args(argv)
    if args.resilience:
        return resilience_rows(Path(args.workdir) / "resilience")
    cfg = ChaosConfig(runs=args.runs, kills=args.kills, steps=args.steps, checkpointing_steps=args.checkpointing_steps, seed=args.seed)
    if args.quick:
        # a kill after two checkpoints exist, then a bit flip in the newest: the resume must reject it,
        # fall back to the older one, and still end bit-identical to the uninterrupted run
        cfg = ChaosConfig(runs=1, kills=2, steps=24, checkpointing_steps=4, seed=args.seed,
                          plan=("sigkill_step", "bitflip"), min_kill_step=10)
    started = time.time()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ref = work / "reference"
    shutil.rmtree(ref, ignore_errors=True)

    # The uninterrupted reference runs alongside the first chaos run (2 cores).
    with ThreadPoolExecutor(max_workers=2) as ex:
        ref_job = ex.submit(run_segment, ref, cfg, False, None, random.Random(0))
        reports: list[RunReport | None] = [None] * cfg.runs
        ref_model = ref / "vidstab" / "checkpoints" / f"step_{cfg.steps:06d}" / "model.safetensors"
        first = ex.submit(chaos_run, 0, cfg, None, work)
        ref_info = ref_job.result()
        reports[0] = first.result()
    ref_ok = ref_info["rc"] == 0 and ref_model.is_file()
    if reports[0].finished and ref_ok:
        reports[0].identical, reports[0].max_abs_diff = weights_equal(
            work / "run0" / "vidstab" / "checkpoints" / f"step_{cfg.steps:06d}" / "model.safetensors", ref_model)
    for i in range(1, cfg.runs):
        reports[i] = chaos_run(i, cfg, ref_model if ref_ok else None, work)

    drills = run_checkpoint_drills(work / "drills")
    print(f"== Chaos: {cfg.runs} run(s) x {cfg.kills} fault(s), {cfg.steps} steps, checkpoint every "
          f"{cfg.checkpointing_steps}, async saves; reference finished: {ref_ok} ==")
    print(f"{'run':>3s} {'faults (landed at step)':60s} {'resumes':>7s} {'lost':>4s} {'finished':>8s} {'identical':>9s}")
    for i, r in enumerate(reports):
        desc = ", ".join(
            (f"{f['fault']}@{f['at_step']}" if f.get("landed") else f"{f['fault']}(missed)") if "fault" in f
            else (f"{f['kind']}:{f.get('checkpoint')}/{f.get('file')}" if "checkpoint" in f else f"{f['kind']}(skipped)")
            for f in r.faults)
        print(f"{i:>3d} {desc[:60]:60s} {r.resumes:>7d} {r.checkpoints_lost:>4d} {str(r.finished):>8s} {str(r.identical):>9s}")
    landed = [f for r in reports for f in r.faults if f.get("landed") or "checkpoint" in f]
    summary = {
        "bench": "chaos", "quick": args.quick, "seconds": round(time.time() - started, 1), "config": asdict(cfg),
        "reference_finished": ref_ok,
        "runs": cfg.runs,
        "faults_applied": len(landed),
        "faults_by_kind": {k: sum(1 for f in landed if (f.get("fault") or f.get("kind")) == k) for k in PROCESS_FAULTS + DISK_FAULTS},
        "runs_resumed": sum(1 for r in reports if r.resumes > 0),
        "resumes": sum(r.resumes for r in reports),
        "runs_finished": sum(1 for r in reports if r.finished),
        "unrecoverable": sum(1 for r in reports if not r.finished),
        # split by cause: a run whose every checkpoint was damaged on purpose cannot resume from one
        "unrecoverable_with_intact_checkpoint": sum(1 for r in reports if not r.finished and (r.intact_before_final or not r.had_checkpoints)),
        "unrecoverable_all_checkpoints_damaged": sum(1 for r in reports if not r.finished and r.had_checkpoints and not r.intact_before_final),
        "checkpoints_lost": sum(r.checkpoints_lost for r in reports),
        "damaged_checkpoints_loaded": sum(r.damaged_loaded for r in reports),
        "sigterm_clean_exits": sum(1 for r in reports for f in r.faults if f.get("clean_exit")),
        "steps_without_metrics_line": sum(len(r.steps_without_metrics) for r in reports),
        "weights_differ": sum(1 for r in reports if r.identical is False),
        "weights_identical": sum(1 for r in reports if r.identical is True),
        "max_abs_diff": max((r.max_abs_diff for r in reports if r.max_abs_diff is not None), default=None),
        "details": [asdict(r) for r in reports],
        "drills": drills,
    }
    print(json.dumps(summary, default=str))
    return summary


def resilience_rows(work: Path) -> dict:
    """The hang / kill / NaN rows (benchmarks/chaos_resilience.py); the last line printed is their JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import chaos_resilience

    started = time.time()
    summary = chaos_resilience.run(work)
    summary["seconds"] = round(time.time() - started, 1)
    chaos_resilience.print_table(summary)
    print(json.dumps(summary, default=str))
    return summary


if __name__ == "__main__":
    main()
