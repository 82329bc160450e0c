"""The tests' launches fork their ranks from the launcher (tests/warm_ranks): a forked rank sees what a fresh one
sees, and ends the same way."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "scripts" / "rank_probe.py"


def _launch(out: Path, warm: bool) -> tuple[dict, subprocess.CompletedProcess]:
    out.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    if not warm:
        env.pop("VIDSTAB_TEST_WARM_RANKS", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(PROBE), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}, proc


def test_a_forked_rank_sees_what_a_fresh_one_sees_and_fails_the_same_way(tmp_path):
    assert os.environ.get("VIDSTAB_TEST_WARM_RANKS") == "1" or os.environ.get("VIDSTAB_TEST_COLD_START")
    warm, warm_proc = _launch(tmp_path / "warm", warm=os.environ.get("VIDSTAB_TEST_WARM_RANKS") == "1")
    cold, cold_proc = _launch(tmp_path / "cold", warm=False)
    for rank in (0, 1):
        assert not cold[rank].pop("preloaded")
        assert warm[rank].pop("preloaded") == (os.environ.get("VIDSTAB_TEST_WARM_RANKS") == "1")
        for what in ("argv", "main"):  # the output folders differ, nothing else
            warm[rank][what] = json.loads(json.dumps(warm[rank][what]).replace("/warm", "/cold"))
        assert warm[rank] == cold[rank], rank
    for proc in (warm_proc, cold_proc):  # rank 1's error, through torch's excepthook, ends the launch
        assert proc.returncode == 1
        assert "[rank1]: ValueError: the probe's uncaught error" in proc.stderr
        assert "failed (exitcode: 1) local_rank: 1" in proc.stderr
