"""A multi-process run that has done all its work exits 0: vidstab's exit fence lets gloo's worker threads
drop their finished work while the interpreter is whole (vidstab/run/exit_fence.py). Without the fence the
script below ends in std::terminate in about 3 runs of 10 on this 2-core machine (measured; a test cannot
assert a race loses, so only the fenced runs are asserted, several times)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from trainer_utils import torchrun_cmd

from vidstab.run.exit_fence import wait_for_quiet_collective_threads

SCRIPT = Path(__file__).parent / "scripts" / "exit_after_collective.py"
REPO = Path(__file__).resolve().parents[1]


def test_fenced_two_process_gloo_script_exits_zero_every_time():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for attempt in range(2):
        proc = subprocess.run(torchrun_cmd(2, SCRIPT, "--fence"), capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"attempt {attempt}: {proc.stderr[-3000:]}"
        assert "terminate called" not in proc.stderr


def test_the_fence_returns_at_once_in_a_process_without_collective_threads():
    assert wait_for_quiet_collective_threads(timeout_s=5.0) is (os.path.isdir("/proc/self/task"))
