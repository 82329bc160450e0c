"""The tests' launches fork their ranks from the launcher (tests/warm_ranks), and the launcher from a pre-imported
interpreter (tests/trainer_utils.warm_run): a forked rank sees what a fresh one sees, and ends the same way."""

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer_utils import warm_run

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "scripts" / "rank_probe.py"
WARM = os.environ.get("VIDSTAB_TEST_WARM_RANKS") == "1"


def _launch(out: Path, warm: bool, nproc: int = 2) -> tuple[dict, subprocess.CompletedProcess]:
    out.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    if not warm:
        env.pop("VIDSTAB_TEST_WARM_RANKS", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *(["--multi_gpu"] if nproc > 1 else []),
           "--num_processes", str(nproc), "--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", str(PROBE), str(out)]
    if warm:
        proc = warm_run(cmd, env=env, cwd=REPO, timeout=120)
    else:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}, proc


def _same(warm: dict, cold: dict) -> None:
    for rank in cold:
        assert not cold[rank].pop("preloaded")
        assert warm[rank].pop("preloaded") == WARM
        for what in ("argv", "main"):  # the output folders differ, nothing else
            warm[rank][what] = json.loads(json.dumps(warm[rank][what]).replace("/warm", "/cold"))
        assert warm[rank] == cold[rank], rank


def test_a_forked_rank_sees_what_a_fresh_one_sees_and_fails_the_same_way(tmp_path):
    assert WARM or os.environ.get("VIDSTAB_TEST_COLD_START")
    warm, warm_proc = _launch(tmp_path / "warm", warm=WARM)
    cold, cold_proc = _launch(tmp_path / "cold", warm=False)
    _same(warm, cold)
    for proc in (warm_proc, cold_proc):  # rank 1's error, through torch's excepthook, ends the launch
        assert proc.returncode == 1
        assert "[rank1]: ValueError: the probe's uncaught error" in proc.stderr
        assert "failed (exitcode: 1) local_rank: 1" in proc.stderr


def test_a_one_process_launchs_forked_script_sees_what_a_fresh_one_sees_and_fails_the_same_way(tmp_path):
    warm, warm_proc = _launch(tmp_path / "warm", warm=WARM, nproc=1)
    cold, cold_proc = _launch(tmp_path / "cold", warm=False, nproc=1)
    _same(warm, cold)
    for proc in (warm_proc, cold_proc):  # Accelerate's launcher tees the script's stderr and fails with it
        assert proc.returncode == 1
        assert proc.stderr.count("ValueError: the probe's uncaught error") == 2, proc.stderr[-2000:]
