"""Run the reference trainer as a real subprocess (1 or 2 processes) and read what it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "train.py"

# Small and fast: a few seconds per run on 2 CPU cores.
FAST = [
    "--num_videos", "16", "--train_batch_size", "4", "--hidden_size", "32", "--num_layers", "2",
    "--num_heads", "2", "--report_to", "none", "--lr_warmup_steps", "2", "--no_async_save",
]


def run_trainer(output_dir: Path, *args: str, nproc: int = 1, timeout: float = 240, check: bool = True,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``recipes/train.py`` like a user would; a hang fails the test instead of blocking CI."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, str(TRAIN)]
    else:
        full_env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", str(TRAIN)]
    cmd += ["--output_dir", str(output_dir), *FAST, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def events(output_dir: Path, rank: int = 0, kind: str | None = None) -> list[dict]:
    path = Path(output_dir) / "vidstab" / f"events-rank{rank}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def losses_by_step(output_dir: Path, rank: int = 0) -> dict[int, float]:
    """The loss of every applied step; after a resume the later record of a step wins."""
    return {r["step"]: r["loss"] for r in events(output_dir, rank, "metrics")}
