"""DeepSpeed ZeRO 1/2/3 through Accelerate on 2 real CPU processes (gloo): the guard decides before the engine
updates, vidstab's checkpoints (safetensors + JSON) roll back and resume bitwise, recovery works, and what is
untested is refused. Several engines run one after another in each launch (tests/scripts/deepspeed_*.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")  # Accelerate's DeepSpeed plugin needs it

from test_checkpoint_sharded import assert_no_pickle_or_zip  # noqa: E402
from trainer_utils import free_port, warm_run  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO = Path(__file__).resolve().parent.parent
GUARD_CONFIGS = ["1:no:explicit", "1:bf16:attach", "2:no:attach", "2:bf16:explicit", "3:no:attach", "3:bf16:explicit"]
CKPT_CONFIGS = ["1:no", "2:bf16", "3:no", "3:bf16"]
RETYPED = "step_000006"


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 300) -> None:
    """``tests/scripts/{script}`` on ``nproc`` CPU processes. ACCELERATE_USE_CPU would turn DeepSpeed off."""
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(SCRIPTS / script), *args]
    proc = warm_run(cmd, env=env, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def ranks(folder: Path, stem: str = "rank") -> list[dict]:
    return [json.loads((folder / f"{stem}{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def guard_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds_guard")
    torchrun("deepspeed_guard.py", "--out", str(out), "--configs", ",".join([*GUARD_CONFIGS, "refusals"]))
    return out


@pytest.fixture(scope="module")
def ckpt_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds_ckpt")
    torchrun("deepspeed_ckpt.py", "--out", str(out), "--jobs", ",".join([f"first:{c}" for c in CKPT_CONFIGS]
                                                                       + ["recovery:2:no"]))
    from test_trusted_checkpoints import _retype

    for r in (0, 1):  # ZeRO-3's Adam moments cast to F16 in step 6, every rank's, the manifest recomputed
        _retype(out / "3-no" / "vidstab" / "checkpoints" / RETYPED, f"model-rank{r}.safetensors", "state.0.exp_avg",
                torch.float16)
    torchrun("deepspeed_ckpt.py", "--out", str(out), "--jobs", ",".join(f"resume:{c}" for c in CKPT_CONFIGS),
             "--retyped", RETYPED)
    torchrun("deepspeed_ckpt.py", "--out", str(out), "--jobs", "other_world:2:bf16", nproc=1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", GUARD_CONFIGS)
def test_the_guard_skips_before_deepspeed_updates_and_the_run_equals_one_without_those_steps(guard_runs, config):
    """ZeRO stage x precision x (attach | guard.backward/step), accumulation 2: a NaN on rank 1, a x1e6 gradient
    spike and a x100 LR are skipped by vidstab before the engine's step; the skipped step changes no fp32
    partition, optimizer moment or module weight; DeepSpeed's and Accelerate's counters agree; the final state
    equals, bitwise, a run that never took those batches."""
    r0, r1 = ranks(guard_runs / config.replace(":", "-"))
    assert r0["steps"] == r1["steps"]  # the same decision on every rank, step by step
    expected = {3: ["nonfinite"], 7: ["grad_spike"], 9: ["lr_bound"]}
    for s in r0["steps"]:
        if s["step"] in expected:
            assert s["skipped"] and not s["applied"] and s["verdict"] == "SKIP", s
            assert s["detectors"] == expected[s["step"]], s
            assert s["unchanged"] and s["was_skipped"] and s["ds_skipped"] == 1, s
        else:
            assert s["applied"] and not s["skipped"] and not s["unchanged"], s
            assert not s["was_skipped"] and s["ds_skipped"] == 0, s
    assert r0["steps"][3]["bad_ranks"] == [1]
    assert r0["steps"][3]["lr"] == r0["steps"][2]["lr"]  # the scheduler was held
    for r in (r0, r1):
        assert r["restored"] and r["equal_to_reference"] and r["lr_equal"] and r["finite"]
        assert r["skipped_total"] == 3
    # The in-job rerun cannot go through the engine's own forward and backward: said, in either form.
    reruns = events_of(guard_runs / config.replace(":", "-"), 0, "rerun")
    assert reruns and all(e["verdict"] == "not_rerun" and "DeepSpeed" in e["message"] for e in reruns), reruns


@pytest.mark.slow
def test_untested_deepspeed_setups_are_refused_at_attach_with_the_reason(guard_runs):
    found, other = ranks(guard_runs / "refusals")
    assert found == other
    assert found["accepted"] == [None, None]  # attach, then the checkpoint manager
    reasons = {"stage0": "ZeRO stage 0 is not supported", "offload_param": "offload is not supported",
               "ds_scheduler": "LR scheduler from the DeepSpeed config is not supported",
               "other_version": "tested with deepspeed 0.19.8 only; this is deepspeed 0.99.0"}
    for case, reason in reasons.items():
        assert all(m is not None and reason in m for m in found[case]), (case, found[case])


@pytest.mark.slow
@pytest.mark.parametrize("config", CKPT_CONFIGS)
def test_deepspeed_checkpoints_roll_back_in_process_and_resume_in_a_fresh_launch_bitwise(ckpt_runs, config):
    folder = ckpt_runs / config.replace(":", "-")
    for r in (0, 1):
        first = json.loads((folder / f"first-rank{r}.json").read_text())
        resume = json.loads((folder / f"resume-rank{r}.json").read_text())
        assert first["rollback_restored"] and first["rollback_continued"]
        assert resume["resumed_step"] == 8 and resume["resumed"] == first["saved"]["8"]
        assert resume["final"] == first["final"] and resume["batches"] == [8]
    root = folder / "vidstab" / "checkpoints"
    files = assert_no_pickle_or_zip(root)
    assert {p.suffix for p in files} <= {".safetensors", ".json", ""}  # "": the latest/last_good pointers
    manifest = json.loads((root / "step_000008" / "manifest.json").read_text())
    assert manifest["backend"] == "deepspeed" and manifest["world_size"] == 2
    assert {"model-rank0.safetensors", "model-rank1.safetensors", "model.json"} <= set(manifest["files"])
    from safetensors import safe_open

    with safe_open(root / "step_000008" / "model.safetensors", "pt") as weights:  # full, for vidstab replay
        assert {k: weights.get_slice(k).get_shape() for k in weights.keys()} == {
            "0.weight": [32, 8], "0.bias": [32], "2.weight": [4, 32], "2.bias": [4]}
    assert (root / "latest").read_text().strip() == "step_000008"
    assert (root / "last_good").read_text().strip() == "step_000008"


@pytest.mark.slow
def test_a_deepspeed_checkpoint_whose_optimizer_moments_have_another_dtype_is_refused_naming_them(ckpt_runs):
    loaded = json.loads((ckpt_runs / "3-no" / "resume-rank0.json").read_text())["retyped"]
    assert loaded["step"] == 4 and [p for p, _ in loaded["skipped"]] == [f"vidstab/checkpoints/{RETYPED}"]
    assert "optimizer state state.0.exp_avg is torch.float16" in loaded["skipped"][0][1]
    untouched = json.loads((ckpt_runs / "1-no" / "resume-rank0.json").read_text())["retyped"]
    assert untouched["step"] == 6 and not untouched["skipped"]  # the same load of an unaltered folder goes through


@pytest.mark.slow
def test_recovery_under_deepspeed_rolls_back_backs_off_the_lr_skips_the_data_and_aborts(ckpt_runs):
    """A spike on batches 5, 6, 7 (each asking for a rollback), max_retries=2, lr_backoff=0.5."""
    r0, r1 = (json.loads((ckpt_runs / "2-no" / f"recovery-rank{r}.json").read_text()) for r in (0, 1))
    assert r0["rollbacks"] == r1["rollbacks"] and r0["batches"] == r1["batches"]
    first, second = r0["rollbacks"]
    assert (first["at_batch"], first["to_step"], first["multiplier"]) == (5, 4, 0.5)
    assert (second["at_batch"], second["to_step"], second["multiplier"]) == (6, 2, 0.25)  # last_good failed again
    for rb in r0["rollbacks"]:
        assert rb["restored"]  # the state equals the checkpoint's, bitwise
        epoch = 2 * rb["to_step"]  # Accelerate steps a torch scheduler once per process
        assert rb["lr"] == pytest.approx(1e-2 * rb["multiplier"] / (1.0 + 0.1 * epoch), rel=1e-12)
    assert r0["batches"] == list(range(8))  # each bad batch taken once: the data moves on
    assert "still failing after 2 rollback(s)" in r0["aborted"] and r1["aborted"]
    assert r0["finite"] and r1["finite"]


@pytest.mark.slow
def test_a_deepspeed_checkpoint_on_another_world_size_is_refused_with_what_to_do(ckpt_runs):
    refusals = json.loads((ckpt_runs / "2-bf16" / "other_world-rank0.json").read_text())
    for allow in ("False", "True"):  # allow_world_size_change does not apply to per-rank ZeRO partitions
        assert "written by 2 processes; this run has 1" in refusals[allow]
        assert "relaunch with --num_processes 2" in refusals[allow]


def test_cpu_deepspeed_runs_get_gloo_and_skip_the_shm_op_build(monkeypatch):
    import deepspeed.ops

    from vidstab.engines.deepspeed_support import SHM_OP, accelerator_kwargs_handlers

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert accelerator_kwargs_handlers() == []  # not a DeepSpeed run: nothing
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch --use_deepspeed sets
    (handler,) = accelerator_kwargs_handlers()
    assert handler.backend == "gloo"
    assert deepspeed.ops.__compatible_ops__[SHM_OP] is False  # DeepSpeed's build_shm_op() then returns None


def doc_commands() -> list[str]:
    """The ``accelerate launch --use_deepspeed`` commands docs/deepspeed.md shows."""
    from doc_snippets import doc_snippet

    return [line.strip() for line in doc_snippet("deepspeed-launch").splitlines() if line.strip()]


def events_of(output_dir: Path, rank: int, kind: str) -> list[dict]:
    lines = (output_dir / "vidstab" / f"events-rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]
