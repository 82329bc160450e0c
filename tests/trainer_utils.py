"""Run the reference trainer as a real subprocess (1 or 2 processes) and read what it leaves behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "train.py"

# Small and fast: a few seconds per run on 2 CPU cores. No report.html (1-1.5 s of matplotlib per run):
# the tests that check the dashboard ask for it (``html_report=True``).
FAST = [
    "--num_videos", "16", "--train_batch_size", "4", "--hidden_size", "32", "--num_layers", "2",
    "--num_heads", "2", "--report_to", "none", "--lr_warmup_steps", "2", "--no_async_save", "--no_html_report",
]


def fast_flags(html_report: bool = False) -> list[str]:
    """:data:`FAST`, with the end-of-run ``report.html`` when ``html_report``."""
    return FAST if not html_report else [a for a in FAST if a != "--no_html_report"]


def _trainer_cmd(output_dir: Path, args: tuple[str, ...], nproc: int, env: dict | None,
                 html_report: bool = False) -> tuple[list[str], dict]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, str(TRAIN)]
    else:
        full_env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", "0", str(TRAIN)]
    return cmd + ["--output_dir", str(output_dir), *fast_flags(html_report), *args], full_env


def _finish(proc: subprocess.Popen, cmd: list[str], outs: tuple, deadline: float, check: bool) -> subprocess.CompletedProcess:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    stdout, stderr = (f.seek(0) or f.read().decode(errors="replace") for f in outs)
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"trainer exited {done.returncode}\nSTDOUT:\n{stdout[-4000:]}\nSTDERR:\n{stderr[-6000:]}")
    return done


def run_trainer(output_dir: Path, *args: str, nproc: int = 1, timeout: float = 240, check: bool = True,
                env: dict | None = None, html_report: bool = False) -> subprocess.CompletedProcess:
    """Launch ``recipes/train.py`` like a user would; a hang fails the test instead of blocking CI."""
    return run_trainers((output_dir, *args), nproc=nproc, timeout=timeout, check=check, env=env, html_report=html_report)[0]


def run_trainers(*runs: tuple, nproc: int = 1, timeout: float = 240, check: bool = True,
                 env: dict | None = None, html_report: bool = False) -> list[subprocess.CompletedProcess]:
    """Launch independent trainer runs at once, each ``(output_dir, *args)`` as for :func:`run_trainer`.

    Runs that do not depend on each other (an uninterrupted reference and the first segment of a resumed
    run, or several bad-flag invocations) overlap their start-up (imports, data, VAE) on the CI's 2 cores;
    each is still its own real process with its own folder (and, with ``nproc > 1``, its own port)."""
    started = []
    deadline = time.monotonic() + timeout
    try:
        for output_dir, *args in runs:
            cmd, full_env = _trainer_cmd(Path(output_dir), tuple(args), nproc, env, html_report)
            # Files, not pipes: a run that is not being read yet never blocks on a full pipe.
            outs = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
            started.append((subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=outs[0], stderr=outs[1]), cmd, outs))
        return [_finish(proc, cmd, outs, deadline, check) for proc, cmd, outs in started]
    finally:
        for proc, _, outs in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for f in outs:
                f.close()


def free_port() -> int:
    """A port free right now on 127.0.0.1 (torchrun's rendezvous with ``--master_port 0`` does not form here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, script: str | Path, *args: str) -> list[str]:
    """``script *args`` on ``nproc`` real CPU processes under torchrun (the launcher ``accelerate launch --multi_gpu``
    runs underneath, without its own start-up), for tests that are not about ``accelerate launch`` itself."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), *args]


def events(output_dir: Path, rank: int = 0, kind: str | None = None) -> list[dict]:
    path = Path(output_dir) / "vidstab" / f"events-rank{rank}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def losses_by_step(output_dir: Path, rank: int = 0) -> dict[int, float]:
    """The loss of every applied step; after a resume the later record of a step wins."""
    return {r["step"]: r["loss"] for r in events(output_dir, rank, "metrics")}
