"""The drills on diffusers' own example scripts (tests/test_diffusers_example.py, tests/test_diffusers_video_example.py):
the launch as a user types it, through the drill harness (tests/scripts/drill.py), and what each drill must leave.

Both scripts are drilled alike: 4 optimizer steps per epoch on 2 processes, their own ``checkpoint-N`` every 2
steps with ``--checkpoints_total_limit 2``, vidstab attached with ``rollback_every=args.checkpointing_steps``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: Faults of the skip drill: a NaN sample on rank 1 at step 3, an LR x10^4 for steps 6, 7 and 8.
SKIP_FAULTS = ("nan@3:1", "lr@6+3=1e4")
#: Fault of the abort drill: an LR x10^4 from step 4 on, for good.
LR_FOR_GOOD = ("lr@4=1e4",)
#: Fault of the kill drill: rank 1 SIGKILLs itself at step 7 (its own checkpoint-6 is the newest).
KILL = ("kill@7:1",)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def launch(script: Path, out: Path, args: list[str], faults: tuple[str, ...] = (), nproc: int = 2,
           max_restarts: int = 0) -> subprocess.CompletedProcess:
    """``script ARGS`` as a user launches it (``accelerate launch``, ``nproc`` CPU processes), unchanged, through
    the drill harness: it injects ``faults`` and, without torchvision, the shim's transforms. ``max_restarts``: the
    launch of docs/faults.md (torch elastic restarts, a fresh rendezvous store per round)."""
    env = _env()
    port = ["--main_process_port", "0"]
    if max_restarts:
        from trainer_utils import free_port

        port = ["--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
                "--max_restarts", str(max_restarts)]
        # the environment of docs/faults.md's launch: a fresh store per round, this job's own rendezvous
        env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PET_STANDALONE="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", *port]
    if nproc > 1:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd.insert(3, "--multi_gpu")
    cmd += [str(REPO / "tests" / "scripts" / "drill.py"), *[x for f in faults for x in ("--fault", f)], str(script), *args]
    from trainer_utils import warm_run  # the tests' pre-imported launcher (fresh under VIDSTAB_TEST_COLD_START=1)

    return warm_run(cmd, env=env, cwd=out.parent, timeout=300)


def changed_lines(diff: str) -> list[str]:
    """The added and removed lines of a unified diff (its ``+++``/``---`` header left out)."""
    return [x for x in diff.splitlines() if x[:1] in "+-" and not x.startswith(("+++", "---"))]


def own_checkpoints(out: Path) -> list[int]:
    """The steps of the script's own ``checkpoint-N`` folders."""
    return sorted(int(m.group(1)) for n in os.listdir(out) if (m := re.fullmatch(r"checkpoint-(\d+)", n)))


def events(out: Path, kind: str, rank: int = 0) -> list[dict]:
    rows = [json.loads(x) for x in (out / "vidstab" / f"events-rank{rank}.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == kind]


def check_skips(run: subprocess.CompletedProcess, out: Path) -> tuple[Path, dict]:
    """After :data:`SKIP_FAULTS` over 3 epochs: both ranks skipped the same steps, nothing rolled back, rank 1's
    bundle names sample #1, and the script's own checkpoints went on. Returns the bundle and its incident.json."""
    assert run.returncode == 0, run.stderr[-4000:]
    for rank in (0, 1):
        skips = {e["step"]: e["detector"] for e in events(out, "skip", rank)}
        assert skips == {3: "nonfinite", 6: "lr_bound", 7: "lr_bound", 8: "lr_bound"}, skips
    assert not events(out, "rollback")
    (incident,) = events(out, "incident", 1)
    bundle = out / incident["path"]
    meta = json.loads((bundle / "incident.json").read_text())
    assert meta["rank"] == 1 and meta["step"] == 3 and meta["bad_sample_ids"] == ["#1"]
    assert own_checkpoints(out) == [10, 12]  # its own saving and --checkpoints_total_limit, as before
    return bundle, meta


def check_replay_names_the_sample(bundle: Path) -> dict:
    """``vidstab replay BUNDLE`` with no code of the user's reproduces the incident and names #1; its report."""
    replay = subprocess.run([sys.executable, "-m", "vidstab", "replay", str(bundle)], capture_output=True, text=True,
                            env=_env(), timeout=300)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    report = json.loads((bundle / "replay_report.json").read_text())
    assert report["reproduced"] and report["data"]["culprits"] == ["#1"], report["verdict"]
    assert "leave-one-out names #1" in replay.stdout
    return report


def check_rollbacks_then_abort(run: subprocess.CompletedProcess, out: Path) -> None:
    """After :data:`LR_FOR_GOOD`: three in-place rollbacks on both ranks, the LR halved each time, then the abort."""
    # An LR bug leaves no incident bundle (lr_bound captures no batch): the message says where the evidence is.
    assert run.returncode != 0 and "vidstab: run aborted" in run.stderr and "No incident bundle was written" in run.stderr
    for rank in (0, 1):
        rollbacks = events(out, "rollback", rank)
        assert len(rollbacks) == 3 and all(r["to_step"] <= 4 for r in rollbacks), rollbacks
        steps = [e["step"] for e in events(out, "skip", rank)]  # in place: the loop's step count went on
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert [r["lr_multiplier"] for r in events(out, "rollback")] == [0.5, 0.25, 0.125]


def check_resumed(killed: subprocess.CompletedProcess, resumed: subprocess.CompletedProcess, out: Path) -> None:
    """After :data:`KILL` over 3 epochs and the script's own ``--resume_from_checkpoint latest``: it resumed from its
    checkpoint-6 with the guard's state, and finished."""
    assert killed.returncode != 0
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Resuming from checkpoint checkpoint-6" in resumed.stdout + resumed.stderr
    assert events(out, "resume")[-1]["step"] == 6  # the guard's state came back with the script's own load_state
    metrics = events(out, "metrics")
    assert metrics[-1]["step"] == 11 and all(np.isfinite(m["loss"]) for m in metrics[-3:])
    assert own_checkpoints(out) == [10, 12]
