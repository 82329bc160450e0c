"""``attach(..., rollback_every=N)``: an unmodified loop rolls back in place inside its own optimizer.step().

Weights, optimizer moments and the guard's statistics go back to the last healthy rollback checkpoint; the
loop's step count, the scheduler's position, the random number generators and the data go on. Real
Accelerate, real checkpoints on disk (2 processes: tests/test_diffusers_example.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import vidstab
from vidstab.checkpoint import CheckpointError
from vidstab.events import iter_event_file


def _loop(out, bad_lr_steps, steps=40, rollback_every=4, nan_steps=(), before_step=None, **attach_kwargs):
    """A plain Accelerate loop; a bug writes the LR x10^4 before each step in ``bad_lr_steps``; the inputs of the
    steps in ``nan_steps`` are NaN; ``before_step(global_step, guard)``: what else happens to the run then."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader = torch.utils.data.DataLoader([{"x": torch.randn(4)} for _ in range(2 * steps)], batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=out, rollback_every=rollback_every, **attach_kwargs)
    seen = []
    global_step = 0
    for batch in loader:
        if before_step is not None:
            before_step(global_step, guard)
        if global_step in bad_lr_steps:
            for group in opt.param_groups:
                group["lr"] = sched.get_last_lr()[0] * 1e4
        loss = model(batch["x"] * float("nan") if global_step in nan_steps else batch["x"]).pow(2).mean()
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        global_step += 1
        seen.append({"step": global_step, "guard_step": guard.global_step, "rand": torch.rand(()).item(),
                     "weights": [p.detach().clone() for p in model.parameters()], "lr": opt.param_groups[0]["lr"],
                     "scheduler_step": sched.scheduler.last_epoch})
        if global_step >= steps:
            break
    return acc, model, opt, sched, guard, seen


def _events(out):
    """Rank 0's event log in file order."""
    return list(iter_event_file(out / "vidstab" / "events-rank0.jsonl"))


def _kinds(out, kind):
    return [e for e in _events(out) if e["kind"] == kind]


def _one_numbering(events):
    """Assert that every event states the loop's step, and the trajectory's beside it where they differ: from an
    in-place rollback at the loop's step S to a checkpoint of trajectory step T on, they are S - T apart (the
    rollback event itself is numbered as before it). Returns the offsets in force after each rollback."""
    offset, offsets = 0, []
    for e in events:
        assert e.get("trajectory_step", e["step"]) == e["step"] - offset, (offset, e)
        assert ("trajectory_step" in e) == bool(offset), (offset, e)
        if e["kind"] == "rollback":
            offset = e["step"] - e.get("to_trajectory_step", e["to_step"])
            offsets.append(offset)
    return offsets


def test_an_lr_written_wrong_for_three_steps_is_refused_and_the_schedule_comes_back(tmp_path):
    acc, model, opt, sched, guard, seen = _loop(tmp_path, bad_lr_steps={10, 11, 12})
    assert [e["step"] for e in _kinds(tmp_path, "skip")] == [10, 11, 12]
    assert not _kinds(tmp_path, "rollback")
    assert all(s["step"] == s["guard_step"] for s in seen)  # the guard counts the loop's steps
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_last_lr()[0])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    guard.close()


def test_an_lr_written_wrong_for_good_rolls_back_in_place_then_aborts(tmp_path):
    with pytest.raises(vidstab.RunAborted, match="No incident bundle was written"):  # an LR bug captures no batch
        _loop(tmp_path, bad_lr_steps=set(range(10, 100)))
    rollbacks = _kinds(tmp_path, "rollback")
    assert [r["lr_multiplier"] for r in rollbacks] == [0.5, 0.25, 0.125]
    assert all(r["to_step"] == 8 for r in rollbacks)
    # In place: the loop's step count goes on past every rollback; no step is taken twice.
    steps = [e["step"] for e in _events(tmp_path) if e["kind"] == "metrics"]
    assert steps == sorted(steps) and len(steps) == len(set(steps))
    # Each rollback sets the trajectory further behind; every event up to the abort's says both.
    offsets = _one_numbering(_events(tmp_path))
    assert offsets == sorted(offsets) and len(offsets) == 3 and offsets[0] > 0
    (stop,) = _kinds(tmp_path, "stop")
    assert stop["exit_code"] == 3 and stop["trajectory_step"] == stop["step"] - offsets[-1]


def test_a_rollback_restores_the_weights_in_place_and_keeps_step_schedule_and_rng_going(tmp_path):
    # 5 refused steps (10-14) ask for a rollback; it happens inside the optimizer step of step 15.
    acc, model, opt, sched, guard, seen = _loop(tmp_path, bad_lr_steps=set(range(10, 16)), steps=24)
    (rollback,) = _kinds(tmp_path, "rollback")
    assert rollback["step"] == 15 and rollback["to_step"] == 8
    by_step = {s["step"]: s for s in seen}
    assert all(torch.equal(a, b) for a, b in zip(by_step[15]["weights"], by_step[8]["weights"]))  # the checkpoint's
    assert by_step[15]["guard_step"] == 15  # the loop's count went on
    assert by_step[15]["rand"] != by_step[8]["rand"]  # the RNG was not wound back to the checkpoint's
    assert by_step[15]["scheduler_step"] >= by_step[9]["scheduler_step"]  # nor the schedule
    assert by_step[16]["lr"] == pytest.approx(0.5 * 1e-2)  # on schedule, with the back-off of the divergence
    assert all(torch.isfinite(p).all() for p in model.parameters())
    own = tmp_path / "checkpoint-24"  # the script's own checkpoint
    acc.save_state(str(own))
    guard.close()
    # The rollback checkpoints after it are named after the loop's step, every 4 steps of the trajectory (12 and 16,
    # 7 steps behind), which each records beside it: the manifest, the checkpoint event, a load.
    root = tmp_path / "vidstab" / "rollback"
    saved = {p.name: json.loads((p / "manifest.json").read_text()) for p in root.glob("step_*")}
    assert {n: (m["step"], m["trajectory_step"]) for n, m in saved.items()} == {
        "step_000008": (8, 8), "step_000019": (19, 12), "step_000023": (23, 16)}
    assert [(e["step"], e.get("trajectory_step"), e["path"]) for e in _kinds(tmp_path, "checkpoint")][-2:] == [
        (19, 12, "vidstab/rollback/step_000019"), (23, 16, "vidstab/rollback/step_000023")]
    # A load (a resume's, in a new manager) reads both numbers back, and the weights of then.
    ckpt = vidstab.CheckpointManager(acc, str(tmp_path), vidstab.CheckpointConfig(subdir="vidstab/rollback"))
    for name, obj in (("model", model), ("optimizer", opt), ("vidstab", guard)):
        ckpt.register(name, obj)
    info = ckpt.load("latest")["_checkpoint"]
    assert (info["path"], info["step"], info["trajectory_step"]) == ("vidstab/rollback/step_000023", 23, 16)
    assert guard.global_step == 23 and all(torch.equal(a, b) for a, b in zip(model.parameters(), by_step[23]["weights"]))
    assert [(e["step"], e["trajectory_step"]) for e in _kinds(tmp_path, "resume")] == [(23, 16)]
    # A folder written before the trajectory step was recorded (script's and trajectory's step one) still loads.
    old = root / "step_000008" / "manifest.json"
    old.write_text(json.dumps({k: v for k, v in saved["step_000008"].items() if k != "trajectory_step"}))
    info = ckpt.load("step_000008")["_checkpoint"]
    assert (info["step"], info["trajectory_step"]) == (8, 8) and [i.trajectory_step for i in ckpt.list()] == [8, 12, 16]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_step[8]["weights"]))
    # One whose trajectory_step is no step number cannot be verified: never loaded.
    (root / "step_000019" / "manifest.json").write_text(json.dumps(dict(saved["step_000019"], trajectory_step="12")))
    with pytest.raises(CheckpointError, match="unreadable manifest \\('trajectory_step' is '12'\\)"):
        ckpt.load("step_000019")
    # A relaunch from the script's own checkpoint numbers on as the run did, the trajectory 7 steps behind.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    relaunched = _loop(tmp_path, set(), steps=1, before_step=lambda step, g: g.accelerator.load_state(str(own)))[4]
    relaunched.close()
    assert [(e["step"], e.get("trajectory_step")) for e in _kinds(tmp_path, "resume")][-1] == (24, 17)
    first = _kinds(tmp_path, "checkpoint")[-1]  # the relaunch's first step is saved
    assert (first["step"], first["trajectory_step"], first["path"]) == (25, 18, "vidstab/rollback/step_000025")


def test_a_relaunch_is_told_how_to_reset_in_the_attached_form_and_attach_can(tmp_path, capsys):
    from accelerate.state import AcceleratorState, GradientState

    with pytest.raises(vidstab.RunAborted) as aborted:  # the LR backed off to x0.125, then the abort
        _loop(tmp_path, bad_lr_steps=set(range(10, 100)))
    assert aborted.value.code == 3  # also a SystemExit: uncaught, the script ends with exit code 3, no traceback
    for reset, multiplier in ((False, 0.125), (True, 1.0)):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc, model, opt, sched, guard, seen = _loop(tmp_path, set(), steps=2,
                                                    recovery=vidstab.RecoveryConfig(reset=reset))
        assert guard.lr_multiplier == multiplier
        guard.close()
    advice = [e["message"] for e in _kinds(tmp_path, "recovery") if e["action"] == "carried_over"]
    assert advice and "attach(..., recovery=RecoveryConfig(reset=True))" in advice[0]
    assert [e for e in _kinds(tmp_path, "recovery") if e["action"] == "reset"]
    with pytest.raises(ValueError, match="pass rollback_every=N with it"):
        vidstab.attach(acc, model, opt, sched, run_dir=tmp_path, recovery=vidstab.RecoveryConfig())


def test_the_attached_form_says_each_skip_and_rollback_and_sums_up_at_close(tmp_path, capsys):
    # Two incidents; a short health window makes the rollback checkpoints after the first rollback healthy, so the
    # second goes back to one saved after the first. A NaN batch at step 37, after both: a skip with a bundle.
    acc, model, opt, sched, guard, seen = _loop(tmp_path, bad_lr_steps=set(range(10, 16)) | set(range(30, 36)),
                                                steps=40, nan_steps={37}, config=vidstab.GuardConfig(health_window=4))
    guard.close()
    err = capsys.readouterr().err.splitlines()
    skips = [x for x in err if "update refused, step skipped (lr_bound:" in x]
    # Steps 10-13 skipped, the fifth in a row (14) rolled back; the bad LR at 15 is refused again, and from then on the
    # loop's step and the trajectory's differ by the 7 steps the rollback undid: both are named.
    assert [x.split(":")[1].strip() for x in skips] == [*(f"step {s}" for s in range(10, 14)), "step 15 (trajectory step 8)",
                                                        *(f"step {s} (trajectory step {s - 7})" for s in range(30, 34)),
                                                        "step 35 (trajectory step 20)"]
    bundle = [x for x in err if "wrote incident bundle" in x]
    assert [x.split(": ")[1] for x in err if "(nonfinite:" in x] + [x.split(": ")[1] for x in bundle] == [
        "step 37 (trajectory step 22)"] * 2, err
    assert bundle[0].endswith("step000037-rank0")  # the bundle's folder is named after the loop's step
    meta = json.loads((tmp_path / "vidstab" / "incidents" / "step000037-rank0" / "incident.json").read_text())
    assert (meta["step"], meta["extra"]["trajectory_step"]) == (37, 22)  # and its record says both
    # Every event the guard and the attached form write states the loop's step, in the loop's order across both
    # rollbacks, and from each rollback on the trajectory's beside it: 7 steps behind after the first, 15 after the
    # second (a rollback event itself is numbered as before it: the failure's trajectory is one behind).
    events = _events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "metrics"] == list(range(40))
    assert _one_numbering(events) == [7, 15]
    first = next(i for i, e in enumerate(events) if e["kind"] == "rollback")
    kinds_after = {e["kind"] for e in events[first + 1:]}
    assert {"metrics", "skip", "rollback_request", "rollback", "checkpoint", "recovery", "incident", "stop"} <= kinds_after
    assert [(e["kind"], e["step"], e["trajectory_step"]) for e in events if e["step"] == 37 and e["kind"] != "metrics"] == [
        ("skip", 37, 22), ("incident", 37, 22), ("rerun", 37, 22)]
    assert [x for x in err if "rolled back in place to" in x] == [
        "vidstab: step 14: rolled back in place to step 8 from vidstab/rollback/step_000008, rollback 1/3 of this "
        "incident, cause divergence, LR multiplier x0.5",
        "vidstab: step 34 (trajectory step 27): rolled back in place to step 27 (trajectory step 20) from "
        "vidstab/rollback/step_000027, rollback 1/3 of this incident, cause divergence, LR multiplier x0.25"]
    assert err[-1].startswith("vidstab: 40 optimizer steps guarded, 11 skipped, 2 rolled back in place; events: vidstab events")
    # The rollback checkpoints are named after the loop's step, saved every 4 steps of the trajectory, which each
    # records beside it; a rollback event names its target both ways; recovery counts the trajectory's steps.
    saves = [(e["step"], e.get("trajectory_step"), e["path"].split("/")[-1]) for e in _kinds(tmp_path, "checkpoint")]
    assert saves == [(1, None, "step_000001"), (4, None, "step_000004"), (8, None, "step_000008"),
                     (12, None, "step_000012"), (19, 12, "step_000019"), (23, 16, "step_000023"),
                     (27, 20, "step_000027"), (31, 24, "step_000031"), (39, 24, "step_000039")]
    rollbacks = [(e["step"], e["failed_step"], e.get("trajectory_step"), e["to_step"], e.get("to_trajectory_step"),
                  e["checkpoint"]) for e in _kinds(tmp_path, "rollback")]
    assert rollbacks == [(15, 14, None, 8, None, "vidstab/rollback/step_000008"),
                         (35, 34, 28, 27, 20, "vidstab/rollback/step_000027")]
    assert [(e["step"], e["action"]) for e in _kinds(tmp_path, "recovery")] == [(23, "incident_over")]
    manifest = json.loads((tmp_path / "vidstab" / "rollback" / "step_000039" / "manifest.json").read_text())
    assert (manifest["step"], manifest["trajectory_step"], manifest["parent"]["name"]) == (39, 24, "step_000027")


def test_without_rollback_every_a_rollback_request_is_said_not_silently_skipped(tmp_path, capsys):
    acc, model, opt, sched, guard, seen = _loop(tmp_path, bad_lr_steps=set(range(10, 16)), steps=16, rollback_every=None)
    guard.close()
    err = capsys.readouterr().err
    assert "vidstab: step 14: a rollback is asked for (consecutive_skips: " in err
    assert "attach(..., rollback_every=N) rolls back in place" in err
    # The summary says it too: the run's last line does not read as if every rollback asked for was made.
    assert err.splitlines()[-1].startswith("vidstab: 16 optimizer steps guarded, 6 skipped (1 of them asked for a "
                                           "rollback this guard could not make: attach(..., rollback_every=N)), 0 rolled")


def test_without_rollback_every_skipping_that_does_not_help_stops_the_run(tmp_path, capsys):
    # The LR stays wrong: steps 10-13 skipped, a rollback asked for at 14, 19 and 24 with nothing applied between.
    with pytest.raises(vidstab.RunAborted) as aborted:
        _loop(tmp_path, bad_lr_steps=set(range(10, 100)), rollback_every=None)
    assert aborted.value.code == 3  # a SystemExit too: exit code 3, no traceback
    assert str(aborted.value).startswith("vidstab: run aborted at step 24: 3 rollbacks asked for in a row since step 14")
    assert "attach(..., rollback_every=N) rolls back in place" in capsys.readouterr().err
    (stop,) = _kinds(tmp_path, "stop")
    assert stop["exit_code"] == 3 and stop["reason"] == "rollback_not_kept" and stop["step"] == 24
    assert [e["step"] for e in _kinds(tmp_path, "skip")][-1] == 24


def test_without_rollback_every_a_rollback_of_the_scripts_own_starts_the_count_again(tmp_path, capsys):
    saved = {}

    def before_step(step, guard):  # the script's own recovery: the guard's state of step 8 loaded before step 20
        if step == 8:
            saved.update(guard.state_dict())
        if step == 20:
            guard.load_state_dict(saved)

    with pytest.raises(vidstab.RunAborted, match="at step 22: 3 rollbacks asked for in a row since step 12"):
        _loop(tmp_path, bad_lr_steps=set(range(10, 100)), rollback_every=None, before_step=before_step)
    asked = [line.split(":")[1].strip() for line in capsys.readouterr().err.splitlines() if "a rollback is asked for" in line]
    assert asked == ["step 14", "step 19", "step 12", "step 17"]  # two before the load, not counted after it


def test_without_rollback_every_non_finite_weights_at_the_end_are_no_exit_code_0(tmp_path, capsys):
    def before_step(step, guard):
        if step == 15:
            with torch.no_grad():
                next(guard.model.parameters()).view(-1)[0] = float("nan")

    acc, model, opt, sched, guard, seen = _loop(tmp_path, set(), steps=16, rollback_every=None, before_step=before_step)
    with pytest.raises(vidstab.RunAborted) as aborted:
        guard.close()
    assert aborted.value.code == 3
    assert "the run ends with non-finite weights on rank 0: do not use what it exported" in str(aborted.value)
    assert _kinds(tmp_path, "stop")[-1]["reason"] == "nonfinite_state"
