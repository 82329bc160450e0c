#!/usr/bin/env python
"""Escalation end to end on slow held-out faults: does acting on a trend save the run, and at what cost?

    python benchmarks/bench_escalation.py            # 4 scenarios x 3 arms + clean twins (~5 min on 2 busy cores)
    python benchmarks/bench_escalation.py --quick    # one short scenario (CI smoke)

The held-out loop of ``scenarios/heldout.py`` (plain-softmax transformer, flow matching), guarded the way
README's own-loop diff guards a user's loop: ``vidstab.attach``, ``CheckpointManager`` (every 20 steps),
``Recovery.after_step``, the data going on after a rollback. Per scenario, arms: unguarded; vidstab with its
defaults; vidstab with ``trend`` off (what escalation adds); ``trend_only`` (the skipping detectors warn only,
so ``trend`` is what acts). Figures: finished or ``RunAborted`` (and
its cause), final loss on fixed latents/noise/timesteps relative to the clean unguarded twin of the same
seed, steps lost (skipped + rolled back, from the event log), first action, and where the unguarded run
fails (the held-out failure rule). A fault is a bug the user fixes once vidstab rolls back (as
``vidstab.faults`` treats an LR ramp): it stops at the first rollback. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.scenarios import heldout as H  # noqa: E402
from benchmarks.scenarios.evaluation import fixed_noise_loss  # noqa: E402
from vidstab.recovery.lr import scale_lrs  # noqa: E402
from vidstab.files.strict_json import dumps_strict  # noqa: E402

FAMILY = "plain_tf_flow"
SEED = 110
CHECKPOINT_EVERY = 20
#: (name, schedule, fault, steps): the slow faults on the held-out transformer.
SCENARIOS = (
    ("logit_growth", "cosine_warmup", "qk_growth@120=0.1", 640),
    ("input_drift", "constant_nowarmup", "input_drift@120=0.01", 400),
    ("lr_ramp_x1.05", "constant_nowarmup", "lr_ramp@120=1.05", 400),
    ("lr_ramp_x1.3", "constant_nowarmup", "lr_ramp@120=1.3", 400),
)
ARMS = ("unguarded", "vidstab", "vidstab_no_trend", "trend_only")
#: ``trend_only``: the detectors that act first on these faults only warn, so what rolls back is ``trend``'s
#: escalation of corroborated warnings, isolated.
WARN_ONLY_IN_TREND_ONLY = ("lr_bound", "input_scale", "grad_spike", "loss_spike", "input_range")


def _fresh_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # Accelerator is a process-wide singleton: one per run here
    GradientState._reset_state()
    return Accelerator(cpu=True)


def run_arm(schedule: str, fault: str | None, steps: int, arm: str, workdir: Path, seed: int = SEED) -> dict:
    """One run of the held-out loop; ``arm`` in ``ARMS``."""
    import vidstab
    from vidstab.config import GuardConfig
    from vidstab.recovery.policy import RunAborted
    from vidstab.reference.objective import step_generator

    run = H.HeldoutRun(FAMILY, schedule, seed, fault, steps=steps)
    kind, onset = run.kind, run.onset
    arg = float(fault.split("=")[1]) if fault and "=" in fault else None
    accelerator = _fresh_accelerator()
    torch.manual_seed(seed)
    model, objective, data, lr0 = H.build(FAMILY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr0, weight_decay=0.0)
    scheduler = H.make_scheduler(schedule, optimizer, steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    guard = ckpt = recovery = None
    if arm != "unguarded":
        cfg = GuardConfig()
        if arm == "vidstab_no_trend":
            cfg.trend.enabled = False
        if arm == "trend_only":
            for name in WARN_ONLY_IN_TREND_ONLY:
                getattr(cfg, name).action = "warn"
        guard = vidstab.attach(accelerator, model, optimizer, scheduler, config=cfg, run_dir=str(workdir), seed=seed)
        ckpt = vidstab.CheckpointManager(accelerator, str(workdir))
        for name, obj in {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler, "vidstab": guard}.items():
            ckpt.register(name, obj)
        recovery = vidstab.Recovery(accelerator, ckpt, guard)
    n = data.shape[0]
    global_step, consumed, active, ramp = 0, 0, fault is not None, 1.0
    losses, aborted, first_rollback = [], None, None
    try:
        while global_step < steps:
            g = torch.Generator().manual_seed(seed * 100_003 + consumed)  # the data goes on after a rollback
            x = data[torch.randint(0, n, (H.batch_size(run, global_step),), generator=g)].clone()
            on = active and global_step >= onset
            if on and kind == "lr_ramp":
                scale_lrs(optimizer, arg, scheduler, as_scheduled=False)  # a wrong schedule, as vidstab.faults
            if on and kind == "input_drift":
                ramp *= 1.0 + arg
                x = x * ramp
            if on and kind == "qk_growth":
                with torch.no_grad():
                    for w in model.qk_weights():
                        w.mul_(1.0 + arg)
            d = objective.sample(x, step_generator(seed, consumed, 0, 0))
            consumed += 1
            loss = objective.per_sample_loss(model, x, d["noise"], d["timesteps"]).mean()
            losses.append(float(loss.detach()))
            if guard is None:
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), H.MAX_GRAD_NORM)
                optimizer.step()
                scheduler.step()
                global_step += 1
                continue
            guard.backward(loss, batch={"latents": x})
            result = guard.step(H.MAX_GRAD_NORM)
            state = recovery.after_step(result, global_step + 1)
            if state is not None:
                first_rollback = global_step if first_rollback is None else first_rollback
                global_step, active = state["step"], False  # the user fixes the bug behind the rollback
                continue
            global_step += 1
            if global_step % CHECKPOINT_EVERY == 0:
                ckpt.save(global_step, healthy=guard.healthy, trainer_state={"step": global_step})
    except RunAborted as e:
        aborted = str(e).splitlines()[0][:200]
    if ckpt is not None:
        ckpt.wait()
    events = [json.loads(x) for p in sorted((workdir / "vidstab").glob("events-rank0*.jsonl")) for x in p.read_text().splitlines() if x.strip()] if guard else []
    skips = sum(1 for e in events if e.get("kind") == "skip")
    rolled = sum(int(e["step"]) - int(e.get("to_step", e["step"])) for e in events if e.get("kind") == "rollback")
    acts = [int(e["step"]) for e in events if e.get("kind") in ("skip", "rollback")]
    causes = sorted({str(e.get("reason") or e.get("cause"))[:80] for e in events if e.get("kind") == "rollback"})
    final = fixed_noise_loss(accelerator.unwrap_model(model), objective, data)
    if guard is not None:
        guard.detach()
    return {"arm": arm, "finished": aborted is None and global_step >= steps, "aborted": aborted,
            "final_loss": final, "steps_lost": None if guard is None else skips + rolled, "skips": skips,
            "rollbacks": sum(1 for e in events if e.get("kind") == "rollback"), "rollback_to": [e.get("to_step") for e in events if e.get("kind") == "rollback"],
            "first_action": min(acts) if acts else None, "rollback_causes": causes, "losses": losses}


def failure_step(losses: list[float], twin: list[float], onset: int) -> int | None:
    """The held-out failure rule (``heldout._failure``) applied to an unguarded run against its clean twin."""
    rec = H.HeldoutRecording("twin", 0, None, FAMILY, loss=twin)
    return next((s for s in range(onset, len(losses)) if H._failure(s, losses[s], rec)), None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="One short scenario (LR x1.3 from step 40 of 100), two arms.")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    scenarios = (("lr_ramp_x1.3", "constant_nowarmup", "lr_ramp@40=1.3", 100),) if args.quick else SCENARIOS
    arms = ("unguarded", "vidstab") if args.quick else ARMS
    out: dict = {"bench": "escalation", "quick": args.quick, "family": FAMILY, "seed": args.seed, "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="vidstab-escalation-") as tmp:
        clean_of: dict = {}
        for name, schedule, fault, steps in scenarios:
            key = (schedule, steps)
            if key not in clean_of:
                clean_of[key] = {a: run_arm(schedule, None, steps, a, Path(tmp) / f"clean-{schedule}-{steps}-{a}", args.seed)
                                 for a in ("unguarded", "vidstab")}
            clean = clean_of[key]
            base = clean["unguarded"]["final_loss"]
            row = {"fault": fault, "steps": steps, "clean_loss": base,
                   "clean_vidstab": {k: clean["vidstab"][k] for k in ("final_loss", "steps_lost", "first_action")}}
            for arm in arms:
                r = run_arm(schedule, fault, steps, arm, Path(tmp) / f"{name}-{arm}", args.seed)
                if arm == "unguarded":
                    row["unguarded_failure_step"] = failure_step(r["losses"], clean["unguarded"]["losses"], H.HeldoutRun(FAMILY, schedule, 0, fault).onset)
                r.pop("losses")
                r["x_clean"] = r["final_loss"] / base if math.isfinite(r["final_loss"]) and base > 0 else math.inf
                row[arm] = r
            out["scenarios"][name] = row
    print(f"\n== Escalation end to end ({FAMILY}, seed {args.seed}, checkpoint every {CHECKPOINT_EVERY}; fault stops at the first rollback) ==")
    print(f"{'scenario':14s} {'arm':17s} {'fails at':>8s} {'1st act':>7s} {'finished':>8s} {'final':>9s} {'x clean':>8s} {'lost':>5s} {'rb':>3s}  rollback to / abort")
    for name, row in out["scenarios"].items():
        for arm in arms:
            r = row[arm]
            fs = row["unguarded_failure_step"] if arm == "unguarded" else None
            print(f"{name:14s} {arm:17s} {str(fs if arm == 'unguarded' else ''):>8s} {str(r['first_action'] or '-'):>7s} {str(r['finished']):>8s} "
                  f"{r['final_loss']:>9.4g} {r['x_clean']:>8.3g} {str(r['steps_lost'] if r['steps_lost'] is not None else '-'):>5s} "
                  f"{r['rollbacks']:>3d}  {r['rollback_to']} {r['aborted'] or ''}")
        c = row["clean_vidstab"]
        print(f"{'':14s} {'clean (twin)':17s} {'':>8s} {str(c['first_action'] or '-'):>7s} {'True':>8s} {row['clean_loss']:>9.4g} {1:>8d} {c['steps_lost']:>5d}"
              f"   (clean guarded: {c['final_loss']:.4g})")
    out["seconds"] = round(time.time() - started, 1)
    print(dumps_strict(out))  # strict JSON: non-finite floats as strings (vidstab.files.strict_json)
    return out


if __name__ == "__main__":
    main()
