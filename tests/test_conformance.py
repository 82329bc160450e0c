"""The conformance matrix (benchmarks/conformance.py writes its table into benchmarks/RESULTS.md): every form x
engine cell through the same drills and the same assertions (tests/scripts/conformance_drill.py), a cell's drills
sharing one launch per world size:

- a NaN on the last rank, a gradient spike, an LR bug for 3 steps: skipped on every rank, the weights, optimizer
  state, EMA and the script's counter bitwise unchanged; no rollback for the LR bug;
- a persistent LR fault: 3 in-place rollbacks, each restoring the weights, optimizer, the guard's detectors, the
  script's registered counter and its EMA (through its own save/load-state hooks in the attached form, registered
  in the explicit one) bitwise as they were at the checkpoint, the LR halved each time; then the abort
  (``RunAborted``; the attached form's exit code 3, the launch's own exit code for its last cell);
- the EMA takes no skipped step;
- SIGKILL of the last rank and the form's own resume (under torch elastic restarts): the state resumed bitwise.

Each drill of each cell passes, or was refused at setup with its reason (an EMA registered under ZeRO-3).
The oom_in_step column runs in tests/test_oom_engines.py (every 2-process cell, the same ``oom_engines.evaluate``).
The reference trainer's ZeRO-3 row runs here (its launches: tests/scripts/conformance_reference.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")  # Accelerate's DeepSpeed plugin needs it

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import conformance_drill as drill  # noqa: E402

FORMS = ("explicit", "attached")  # the attached form last: the launch ends with its abort
TWO = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
FAULT_DRILLS = ("nan", "spike", "lr_bug", "persistent", "ema")


def _cells(world: int) -> list[str]:
    return [f"{f}:{e}" for e in (("single",) if world == 1 else TWO) for f in FORMS]


KILL_CELLS = {world: _cells(world) for world in (1, 2)}
"""SIGKILL + resume of every cell: one launch per world size, one torch elastic restart serving all its cells."""


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("conformance")
    return {world: (drill.launch(_cells(world), "faults", out / f"w{world}", world), out / f"w{world}")
            for world in (1, 2)}


@pytest.fixture(scope="module")
def kills(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("conformance_kill")
    return {world: (drill.launch(cells, "kill", out / f"w{world}", world), out / f"w{world}")
            for world, cells in KILL_CELLS.items()}


def _ok(result: dict, drill_name: str, cell: str) -> None:
    if result["status"] == "refused":  # refused with its reason, never silently degraded
        assert result["why"].startswith("cannot register"), (cell, result)
        return
    assert result["status"] == "pass", (cell, drill_name, result.get("why"))


@pytest.mark.slow
@pytest.mark.parametrize("cell", _cells(1) + _cells(2))
def test_every_cell_passes_the_same_fault_drills(faults, cell):
    form, engine = cell.split(":")
    world = 1 if engine == "single" else 2
    proc, out = faults[world]
    results = drill.evaluate_faults(out / f"{form}-{engine}", form, world)
    for name in FAULT_DRILLS:
        _ok(results[name], name, cell)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_rollbacks_restore_from_host_memory_and_deepspeeds_from_its_files_said_once_per_cell(faults, world):
    """Every cell sets ``rollback_memory_budget_bytes``: full-state cells roll back from the copy in host memory
    (the first rollback, to the checkpoint held);
    DeepSpeed's checkpoints are its engine's, so its cells roll back from the files (the persistent drill checks
    the restore bitwise) and the main process says so in one line per cell, not one per rollback."""
    proc, out = faults[world]
    for cell in _cells(world):
        form, engine = cell.split(":")
        sources = drill.rollback_sources(out / f"{form}-{engine}", world)
        if engine.startswith("zero"):
            assert sources == {"files"}, (cell, sources)
        elif engine in ("single", "ddp"):  # a later rollback to an older checkpoint than the one held: the files
            assert "memory" in sources and sources <= {"memory", "files"}, (cell, sources)
        else:  # FSDP2: from memory after an async sharded save, from the files after a synchronous one
            assert sources and sources <= {"memory", "files"}, (cell, sources)
    zero_cells = sum(cell.split(":")[1].startswith("zero") for cell in _cells(world))
    assert (proc.stdout + proc.stderr).count(drill.FROM_FILES_LINE) == zero_cells, (proc.stderr[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_the_last_cell_ends_the_launch_with_the_attached_forms_exit_code_and_no_traceback(faults, world):
    proc, _ = faults[world]
    log = proc.stdout + proc.stderr
    assert proc.returncode == drill.ABORT_EXIT_CODE if world == 1 else proc.returncode != 0, log[-3000:]
    if world > 1:  # the launcher names the first rank to end and its code
        assert f"exitcode  : {drill.ABORT_EXIT_CODE}" in log, log[-3000:]
    # No rank's traceback (the launcher's own report of the failed child aside).
    assert not [x for x in log.splitlines() if x.startswith("[rank") and "Traceback" in x], log[-3000:]
    assert world > 1 or "Traceback" not in log


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_the_attached_form_says_each_refusal_rollback_and_abort_once_on_the_main_process(faults, world):
    proc, out = faults[world]
    lines = (proc.stdout + proc.stderr).splitlines()
    attached = [c for c in _cells(world) if c.startswith("attached:")]
    skips = 0  # refused updates: the LR-bound skips, but those whose step asked for a rollback (said as one)
    for cell in attached:
        events = drill._lines(out / cell.replace(":", "-") / "faults" / "vidstab" / "events-rank0.jsonl")
        rolled = {e["step"] for e in events if e["kind"] == "rollback_request"}
        skips += len([e for e in events if e["kind"] == "skip" and "lr_bound" in e["detector"]
                      and e["step"] not in rolled])
    refused = [x for x in lines if x.startswith("vidstab: step") and "update refused" in x and "lr_bound" in x]
    assert skips and len(refused) == skips  # one line per refused update: the main process's, not one per rank
    rolled = [x for x in lines if x.startswith("vidstab: step") and "rolled back in place to" in x]
    assert len(rolled) == drill.MAX_RETRIES * len(attached)
    aborted = [x for x in lines if x.startswith(f"vidstab: run aborted: still failing after {drill.MAX_RETRIES}")]
    assert len(aborted) == len(attached)


@pytest.mark.slow
def test_the_attached_form_on_a_model_sharded_outside_accelerate_says_its_own_resume_cannot_work(faults):
    _, out = faults[2]
    (warned,) = drill.attach_warnings(out / "attached-fsdp2" / "faults")
    assert "sharded with fully_shard outside Accelerate" in warned and "explicit form" in warned
    assert not drill.attach_warnings(out / "attached-ddp" / "faults")


@pytest.mark.slow
def test_an_ema_registered_under_zero3_is_refused_with_what_to_use_instead(faults):
    _, out = faults[2]
    why = drill.refusals(out / "explicit-zero3" / "faults")["ema"]
    assert "ZeRO-3" in why and "ZeRO-1 or -2" in why and "rollback_every" in why


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for cells in KILL_CELLS.values() for c in cells])
def test_a_sigkilled_rank_resumes_bitwise_in_the_forms_own_way(kills, cell):
    form, engine = cell.split(":")
    world = 1 if engine == "single" else 2
    proc, out = kills[world]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = drill.evaluate_kill(out / f"{form}-{engine}", world)
    if cell == "attached:fsdp2":  # the user's own save_state cannot resume a model sharded outside Accelerate
        assert result["status"] == "warned" and "said at attach" in result["why"], result
        return
    assert result["status"] == "pass", (cell, result.get("why"))


# ---- the reference trainer (recipes/train.py) under DeepSpeed: docs/deepspeed.md's launch, ZeRO-3 in CI ----
# benchmarks/conformance.py runs every engine's row; CI runs ZeRO-3's (the engine path the others' share least),
# each launch shared by the assertions below.
REFERENCE_ENGINE = "zero3"


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory) -> tuple[Path, dict]:
    import conformance_reference as reference

    out = tmp_path_factory.mktemp("conformance_reference")
    return out, {kind: reference.launch(REFERENCE_ENGINE, kind, out, timeout=600)
                 for kind in reference.kinds(REFERENCE_ENGINE)}


def test_the_reference_trainers_launch_is_the_one_docs_deepspeed_gives():
    import conformance_reference as reference
    from test_deepspeed import doc_commands

    commands = {c.split("--zero_stage ")[1].split()[0]: c.split() for c in doc_commands()}
    assert set(commands) == {"1", "2", "3"}, commands
    for stage, words in commands.items():
        argv, env = reference.command(f"zero{stage}", Path("OUT"))
        assert "ACCELERATE_USE_CPU" not in env  # it would turn DeepSpeed off
        assert argv[1:3] == ["-m", "accelerate.commands.launch"] and argv[argv.index("--output_dir") - 1] == \
            str(reference.REPO / words[-1])
        for flag, value in zip(words[2:-1], words[3:-1] + [""]):
            if flag.startswith("--"):
                assert flag in argv and (value.startswith("--") or argv[argv.index(flag) + 1] == value), flag


@pytest.mark.slow
def test_the_reference_trainer_under_zero3_passes_the_fault_drills_and_refuses_its_ema(reference_runs):
    import conformance_reference as reference

    out, procs = reference_runs
    row = reference.evaluate_faults(out / "faults", REFERENCE_ENGINE, procs["faults"], procs["ema_refusal"])
    for name in ("nan", "spike", "lr_bug", "persistent"):
        assert row[name]["status"] == "pass", (name, row[name].get("why"))
    assert row["ema"]["status"] == "refused" and "use --zero_stage 1 or 2 with --use_ema" in row["ema"]["why"]
    refused = procs["ema_refusal"].stdout + procs["ema_refusal"].stderr  # and the clip, in the same launch
    assert f"--max_grad_norm {reference.REFUSED_CLIP} differs from DeepSpeed's gradient_clipping 1.0" in refused
    for rank in (0, 1):  # the NaN on rank 1, skipped in lockstep
        (skip,) = [e for e in reference.events(out / "faults", rank) if e["kind"] == "skip"
                   and e["detector"] == "nonfinite"]
        assert skip["bad_ranks"] == [1]
    manifest = json.loads((out / "faults" / "vidstab" / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert manifest["backend"] == "deepspeed" and manifest["world_size"] == 2


@pytest.mark.slow
def test_the_reference_trainer_under_zero3_resumes_a_sigkilled_rank_bitwise_exports_and_replays(reference_runs):
    import conformance_reference as reference
    from vidstab.tools.replay import replay

    out, procs = reference_runs
    kill = out / "kill"
    assert reference.evaluate_kill(kill, REFERENCE_ENGINE, procs["kill"]) == {"status": "pass"}
    manifest = json.loads((kill / "vidstab" / "checkpoints" / f"step_{reference.KILL_TOTAL:06d}" /
                           "manifest.json").read_text())
    assert manifest["backend"] == "deepspeed" and manifest["world_size"] == 2
    assert (kill / "transformer" / "diffusion_pytorch_model.safetensors").exists()  # gathered from the partitions
    # The bundle rank 1 wrote replays on the full weights of the checkpoint it names (gathered at ZeRO-3).
    (incident,) = [e for e in reference.events(kill, 1) if e["kind"] == "incident"]
    report = replay(kill / incident["path"])
    assert report.checkpoint_step == reference.SAVE_EVERY and report.reproduced is True


@pytest.mark.slow
def test_the_reference_trainer_under_zero3_stops_on_an_oom_inside_the_engines_step_with_what_to_do(reference_runs):
    import conformance_reference as reference

    out, procs = reference_runs
    result = reference.evaluate_oom_stop(out / "oom", REFERENCE_ENGINE, procs["oom"])
    assert result["status"] == "stopped", result


@pytest.mark.slow
def test_the_reference_trainer_under_zero3_skips_a_forward_oom_in_lockstep_without_re_splitting(reference_runs):
    """DeepSpeed accumulates inside its engine, so a forward OOM on rank 1 is skipped on both ranks (the engine's
    overflow path), not re-run in pieces nor rolled back, and the event says what to lower."""
    import conformance_reference as reference

    import vidstab

    out, _ = reference_runs
    oom, step = out / "oom", reference.DS_FORWARD_OOM
    ooms = vidstab.read_events(oom, "oom")
    assert [(e["step"], e["rank"], e["phase"]) for e in ooms if e["phase"] == "forward"] == [(step, 1, "forward")]
    for rank in (0, 1):
        skips = [e for e in vidstab.read_events(oom, "skip") if e["rank"] == rank and e["step"] == step]
        assert [(e["detector"], e["bad_ranks"]) for e in skips] == [("oom", [1])]
        (retry,) = [e for e in vidstab.read_events(oom, "oom_retry") if e["rank"] == rank]
        assert retry["step"] == step and retry["applied"] is False and "--gradient_accumulation_steps" in retry["message"]
    assert not vidstab.read_events(oom, ("rollback_request", "rollback"))
    steps = [e["step"] for e in vidstab.read_events(oom, "metrics") if e["rank"] == 0]
    assert steps[0] == 0 and steps.count(step) == 1  # taken once: not re-run in pieces
