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
The oom_in_step column runs in tests/test_oom_engines.py (every cell, the same ``oom_engines.evaluate``).
DDP on 16 processes runs both forms' cells (``ddp@16``), its oom_in_step cells in tests/test_oom_engines.py.
Every row of the reference trainer runs here (its launches: tests/scripts/conformance_reference.py), and carries
the assertions of the trainer tests whose launches they replaced: every cell of benchmarks/conformance.py's table
runs in CI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")  # Accelerate's DeepSpeed plugin needs it

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import conformance_drill as drill  # noqa: E402
import conformance_reference as reference  # noqa: E402

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


def _ok(result: dict) -> bool:
    """The drill passed, or was refused at setup with its reason: never silently degraded."""
    if result["status"] == "refused":
        return result["why"].startswith("cannot register")
    return result["status"] == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("cell", _cells(1) + _cells(2))
def test_every_cell_passes_the_same_fault_drills(faults, cell):
    form, engine = cell.split(":")
    world = 1 if engine == "single" else 2
    proc, out = faults[world]
    results = drill.evaluate_faults(out / f"{form}-{engine}", form, world)
    for name in FAULT_DRILLS:
        assert _ok(results[name]), (cell, name, results[name])


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
    if cell == "attached:fsdp2":  # the user's own save_state cannot resume a model sharded outside Accelerate:
        # said at attach, and its load_state refused before anything is loaded (exit code 2, no traceback)
        assert result["status"] == "refused_resume" and "said at attach" in result["why"], result
        assert "the resume: " in result["why"] and "saves rank 0's optimizer shards only" in result["why"], result
        return
    assert result["status"] == "pass", (cell, result.get("why"))


RANKS16 = [f"{form}:ddp" for form in FORMS]


@pytest.fixture(scope="module")
def ranks16(tmp_path_factory) -> dict:
    """DDP on 16 processes, the lockstep at more ranks than 4 (gloo, the drills' tiny model): the fault drills'
    launch and the SIGKILL + resume launch of both forms' cells, ``{kind: (the launch, its folder)}``."""
    out = tmp_path_factory.mktemp("conformance16")
    return {kind: (drill.launch(RANKS16, kind, out / kind, 16), out / kind) for kind in ("faults", "kill")}


@pytest.mark.slow
@pytest.mark.parametrize("cell", RANKS16)
def test_on_16_processes_ddp_passes_the_fault_drills_and_resumes_a_sigkilled_rank_bitwise(ranks16, cell):
    form, engine = cell.split(":")
    proc, out = ranks16["faults"]
    results = drill.evaluate_faults(out / f"{form}-{engine}", form, 16)
    for name in FAULT_DRILLS:
        assert _ok(results[name]), (cell, name, results[name])
    proc, out = ranks16["kill"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = drill.evaluate_kill(out / f"{form}-{engine}", 16)
    assert result["status"] == "pass", (cell, result.get("why"))


# ---- the reference trainer (recipes/train.py): every row of benchmarks/conformance.py ----
# One module fixture per engine, each its own xdist group (the two workers share the rows out); each row's launches
# shared by the assertions below, and by those of the trainer tests they replaced.
def _rows(*engines: str) -> list:
    return [pytest.param(e, id=e, marks=pytest.mark.xdist_group(f"conformance-reference-{e}")) for e in engines]


REFERENCE_ENGINES = tuple(reference.ENGINES)  # every row of benchmarks/conformance.py's table
ZERO_ENGINES = tuple(e for e in REFERENCE_ENGINES if e.startswith("zero"))
BACKENDS = {"single": "full", "ddp": "full", "fsdp2": "sharded"}  # the checkpoint backend; ZeRO: "deepspeed"


@pytest.fixture(scope="module")
def reference_runs(request, tmp_path_factory) -> tuple[str, Path, dict]:
    """``(engine, folder, {kind: the launch's CompletedProcess})`` of the engine ``request.param``'s row."""
    return (request.param, *reference.shared_row(tmp_path_factory, request.param))


def test_the_reference_trainers_launch_is_the_one_docs_deepspeed_gives():
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
@pytest.mark.parametrize("reference_runs", _rows(*REFERENCE_ENGINES), indirect=True)
def test_the_reference_trainer_passes_the_fault_drills_on_every_engine(reference_runs):
    """Every drill passes; ZeRO-3 refuses ``--use_ema`` (and a clip other than DeepSpeed's) at setup, said."""
    engine, out, procs = reference_runs
    world = reference.ENGINES[engine]
    row = reference.evaluate_faults(out / "faults", engine, procs["faults"], procs.get("ema_refusal"))
    for name in ("nan", "spike", "lr_bug", "persistent", *(() if engine in ZERO_ENGINES else ("oom_in_step",))):
        assert row[name]["status"] == "pass", (engine, name, row[name].get("why"))
    if engine == "zero3":
        assert row["ema"]["status"] == "refused" and "use --zero_stage 1 or 2 with --use_ema" in row["ema"]["why"]
        refused = procs["ema_refusal"].stdout + procs["ema_refusal"].stderr  # and the clip, in the same launch
        assert f"--max_grad_norm {reference.REFUSED_CLIP} differs from DeepSpeed's gradient_clipping 1.0" in refused
    else:
        assert row["ema"]["status"] == "pass", (engine, row["ema"].get("why"))
    for rank in range(world):  # the NaN on the last rank, skipped in lockstep
        (skip,) = [e for e in reference.events(out / "faults", rank) if e["kind"] == "skip"
                   and e["detector"] == "nonfinite"]
        assert skip["bad_ranks"] == [world - 1]
    manifest = json.loads((out / "faults" / "vidstab" / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert manifest["backend"] == BACKENDS.get(engine, "deepspeed") and manifest["world_size"] == world


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows(*REFERENCE_ENGINES), indirect=True)
def test_the_reference_trainer_resumes_a_sigkilled_rank_bitwise_and_exports_on_every_engine(reference_runs):
    engine, out, procs = reference_runs
    kill = out / "kill"
    result = reference.evaluate_kill(kill, engine, procs["kill"])
    assert result["status"] == "pass", (engine, result.get("why"))
    manifest = json.loads((kill / "vidstab" / "checkpoints" / f"step_{reference.KILL_TOTAL:06d}" /
                           "manifest.json").read_text())
    assert manifest["world_size"] == reference.ENGINES[engine]
    assert manifest["backend"] == BACKENDS.get(engine, "deepspeed"), manifest["backend"]
    assert (kill / "transformer" / "diffusion_pytorch_model.safetensors").exists()  # ZeRO-3: gathered
    if engine != "zero3":
        assert (kill / "transformer_ema" / "diffusion_pytorch_model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows("zero3"), indirect=True)
def test_the_reference_trainers_bundle_under_zero3_replays_on_the_gathered_weights(reference_runs):
    from vidstab.tools.replay import replay

    _, out, _ = reference_runs
    kill = out / "kill"
    # The bundle rank 1 wrote replays on the full weights of the checkpoint it names (gathered at ZeRO-3).
    (incident,) = [e for e in reference.events(kill, 1) if e["kind"] == "incident"]
    report = replay(kill / incident["path"])
    assert report.checkpoint_step == reference.SAVE_EVERY and report.reproduced is True


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows(*ZERO_ENGINES), indirect=True)
def test_the_reference_trainer_under_deepspeed_stops_on_an_oom_inside_the_engines_step_with_what_to_do(reference_runs):
    engine, out, procs = reference_runs
    result = reference.evaluate_oom_stop(out / "oom", engine, procs["oom"])
    assert result["status"] == "stopped", (engine, result)


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows(*ZERO_ENGINES), indirect=True)
def test_the_reference_trainer_under_deepspeed_skips_a_forward_oom_in_lockstep_without_re_splitting(reference_runs):
    """DeepSpeed accumulates inside its engine, so a forward OOM on rank 1 is skipped on both ranks (the engine's
    overflow path), not re-run in pieces nor rolled back, and the event says what to lower."""
    import vidstab

    _, out, _ = reference_runs
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


# ---- the trainer tests the rows' launches carry (each was a launch of its own) ----

@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows(*REFERENCE_ENGINES), indirect=True)
def test_the_reference_trainers_schedule_bug_for_good_rolls_back_then_stops_with_a_message(reference_runs):
    """``lr_base``: the scheduler's own base LRs x1e4 from the persistent fault on, written again after every
    rollback. The guard refuses the steps, escalates to rollbacks (skips in a row or the share of skipped steps,
    ``skip_rate``) and, past the retry budget, stops with the message and the command that shows the evidence."""
    engine, out, procs = reference_runs
    faults, proc = out / "faults", procs["faults"]
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "vidstab: run aborted" in said, (engine, said[-3000:])
    assert f"vidstab events {faults} --kind skip" in said, engine
    ev = reference.events(faults, 0)
    rollbacks = [e for e in ev if e["kind"] == "rollback"]
    assert len(rollbacks) == drill.MAX_RETRIES and all(r["to_step"] <= drill.PERSISTENT for r in rollbacks), rollbacks
    # The trainer's step rewinds with the weights: its folders and events carry one numbering, the script's.
    assert all(r["checkpoint"].endswith(f"step_{r['to_step']:06d}") and "to_trajectory_step" not in r
               and "trajectory_step" not in r for r in rollbacks), rollbacks
    saves = [e for e in ev if e["kind"] == "checkpoint"]
    assert saves and all(e["path"].endswith(f"step_{e['step']:06d}") and "trajectory_step" not in e for e in saves)
    assert [e["action"] for e in ev if e["kind"] == "recovery"][-1] == "abort"


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows("ddp"), indirect=True)
def test_the_reference_trainer_resumed_on_2_processes_replays_what_it_logged_quietly(reference_runs):
    """The resumed attempt replays steps the first one logged (rank 0's line, every step, fingerprints every rank's
    batch): the resume-fidelity check compares them and stays quiet on every rank."""
    _, out, _ = reference_runs
    kill = out / "kill"
    metrics = [e for e in reference.events(kill, 0) if e["kind"] == "metrics"]
    assert all(isinstance(m["batch_fp"], str) for m in metrics)
    steps = [m["step"] for m in metrics]
    assert all(steps.count(s) == 2 for s in range(reference.RESUMED_AT, reference.KILL_AT)), steps
    for rank in (0, 1):
        assert not [e for e in reference.events(kill, rank) if e["kind"] == "warn"
                    and e.get("detector") == "resume_fidelity"], rank


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows("fsdp2"), indirect=True)
def test_fsdp_nan_on_rank1_skipped_in_lockstep_resume_is_bitwise_and_resumes_in_one_process(reference_runs, tmp_path):
    """``--fsdp --use_ema`` (FSDP2 per DiT block, sharded DCP checkpoints): the row's killed and resumed run ends
    bitwise on the weights and EMA of the same run uninterrupted, and its 2-process checkpoint resumes in 1 process."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from trainer_utils import events, losses_by_step, run_trainer

    _, out, _ = reference_runs
    split, full = out / "kill", tmp_path / "full"
    done = reference.run("fsdp2", full, "--vidstab_config", str(out / "vidstab_config.json"), "--use_ema",
                         "--max_train_steps", str(reference.KILL_TOTAL), "--checkpointing_steps",
                         str(reference.SAVE_EVERY), "--inject_fault",
                         f"nan_batch@{reference.KILL_NAN}:1", "--inject_fault",
                         f"flaky_activation@{reference.KILL_FLAKY}:1")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    skipped = [reference.KILL_NAN, reference.KILL_FLAKY]
    for rank in (0, 1):
        assert [e["step"] for e in events(full, rank, "skip")] == skipped, rank  # lockstep: both ranks skip
        assert [e["step"] for e in events(split, rank, "skip")] == skipped, rank
    a, b = losses_by_step(full, 0), losses_by_step(split, 0)  # the step's loss (rank 0 logs every step)
    applied = [s for s in range(reference.KILL_TOTAL) if s not in skipped]
    assert [a[s] for s in applied] == [b[s] for s in applied], (a, b)

    def shards(output_dir) -> dict:  # every rank's shards of the last checkpoint (model, EMA, optimizer)
        folder = output_dir / "vidstab" / "checkpoints" / f"step_{reference.KILL_TOTAL:06d}" / "dcp"
        files = sorted(folder.glob("*.safetensors"))
        assert len(files) == 2, files  # one file per rank: each wrote its own shards
        return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}

    a, b = shards(full), shards(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
    assert any(k.split(":")[1].startswith("ema.") for k in a), "the EMA is not in the sharded checkpoint"
    # The EMA was updated on each rank's shard, saved and resumed through DCP, and exported gathered.
    ema_full, ema_split = (load_file(str(d / "transformer_ema" / "diffusion_pytorch_model.safetensors"))
                           for d in (full, split))
    live = load_file(str(full / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert ema_full.keys() == live.keys() and all(torch.equal(ema_full[k], ema_split[k]) for k in ema_full)
    assert any(not torch.equal(ema_full[k], live[k]) for k in live)
    assert all(torch.isfinite(v).all() for k, v in a.items() if v.is_floating_point())
    # The 2-process sharded checkpoint resumes in 1 process (DCP reshards on load).
    one = tmp_path / "one"
    shutil.copytree(split, one)
    steps = reference.KILL_TOTAL + 2
    proc = run_trainer(one, "--max_train_steps", str(steps), "--fsdp", "--use_ema", "--checkpointing_steps", "4",
                       "--vidstab_config", str(out / "vidstab_config.json"), "--resume_from_checkpoint", "latest")
    assert f"done: {steps}/{steps} steps" in proc.stdout
    assert [r["step"] for r in events(one, kind="resume")][-1] == reference.KILL_TOTAL


@pytest.mark.slow
@pytest.mark.parametrize("reference_runs", _rows("fsdp2"), indirect=True)
def test_under_fsdp_every_rank_reruns_together_without_a_peer_check(reference_runs):
    """The NaN sample (data) and the transient fault of the FSDP2 row's kill launch, both on rank 1: every rank
    re-runs the step together and classifies it, with no peer check (the ranks hold different shards)."""
    from trainer_utils import events

    _, out, _ = reference_runs
    reruns = {r: events(out / "kill", r, kind="rerun") for r in (0, 1)}
    assert [(e["step"], e["verdict"], e["ranks"], e["peer"]) for e in reruns[0]] == [
        (reference.KILL_NAN, "data", [1], {}), (reference.KILL_FLAKY, "transient", [1], {})]
    assert [e["verdict"] for e in reruns[1]] == ["data", "transient"]
    assert len(reruns[1][0]["samples"]) == 4
