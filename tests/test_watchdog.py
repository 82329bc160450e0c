"""The hang watchdog, the restart bookkeeping and the hang/kill/slow drills, on real threads, files and processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from vidstab.run.elastic import LaunchInfo, previous_attempt, shared_store_warning
from vidstab.events import EventLog
from vidstab.faults import Fault, FaultInjector, validate_faults
from vidstab.run.watchdog import WATCHDOG_EXIT_CODE, Watchdog, WatchdogConfig

from trainer_utils import REPO, TRAIN


def _script(tmp_path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path), str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_a_hung_rank_dumps_every_threads_stack_logs_a_hang_event_and_exits_75(tmp_path):
    proc = _script(tmp_path, """
        import sys, threading, time
        from vidstab.run.watchdog import Watchdog, WatchdogConfig

        def stuck_in_the_data_loader():
            time.sleep(600)

        def helper_thread_waiting():
            time.sleep(600)

        threading.Thread(target=helper_thread_waiting, daemon=True).start()
        wd = Watchdog(sys.argv[1], rank=3, config=WatchdogConfig(timeout_s=3, multiple=10, first_step_s=30)).start()
        for step in range(3):
            wd.beat(step, "data")
            wd.beat(step, "forward_backward")
        wd.beat(3, "data")
        stuck_in_the_data_loader()
    """)
    assert proc.returncode == WATCHDOG_EXIT_CODE == 75, proc.stderr[-3000:]
    stacks = (tmp_path / "run" / "vidstab" / "hang-rank3-step000003.txt").read_text()
    assert "rank 3 made no progress" in stacks and "'data' of step 3" in stacks
    assert "stuck_in_the_data_loader" in stacks and "helper_thread_waiting" in stacks  # every thread, not just one
    hang = [json.loads(line) for line in (tmp_path / "run" / "vidstab" / "events-rank3.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in hang] == ["hang"]
    assert hang[0]["step"] == 3 and hang[0]["phase"] == "data" and hang[0]["exit_code"] == 75
    assert hang[0]["stacks"] == "vidstab/hang-rank3-step000003.txt"


def test_a_rank_that_keeps_getting_slower_but_keeps_going_is_never_killed(tmp_path):
    # Each step takes twice the one before (0.25 s ... 4 s), past the 1.5 s floor: the deadline follows the
    # slowest step seen, so only a rank that stops altogether is declared hung.
    proc = _script(tmp_path, """
        import sys, time
        from vidstab.run.watchdog import Watchdog, WatchdogConfig

        with Watchdog(sys.argv[1], config=WatchdogConfig(timeout_s=1.5, multiple=10, first_step_s=30)) as wd:
            pause = 0.25
            for step in range(5):
                wd.beat(step, "data")
                wd.beat(step, "forward_backward")
                time.sleep(pause)
                pause *= 2
            wd.beat(5, "checkpoint")
            time.sleep(0.2)
        print("finished", wd.fired)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished None" in proc.stdout
    assert not list((tmp_path / "run").glob("vidstab/hang-*"))


def test_the_deadline_comes_from_the_slowest_step_and_checkpoint_seen(tmp_path):
    cfg = WatchdogConfig(timeout_s=0.01, multiple=10, first_step_s=123)
    wd = Watchdog(tmp_path, config=cfg)
    assert wd.timeout_for("data") == wd.timeout_for("checkpoint") == 123  # nothing seen yet: first-step allowance
    wd.beat(0, "data")
    wd.beat(0, "forward_backward")
    wd.beat(1, "checkpoint")  # step 0 completed
    assert wd.timeout_for("data") == max(cfg.timeout_s, 10 * wd.slowest_step_s) < 123
    assert wd.timeout_for("checkpoint") == 123  # no checkpoint completed yet
    time.sleep(0.3)
    wd.beat(1, "data")  # checkpoint done: it is timed apart and does not inflate the step deadline
    assert wd.slowest_checkpoint_s >= 0.3 > wd.slowest_step_s
    assert wd.timeout_for("checkpoint") == 10 * wd.slowest_checkpoint_s
    with wd.paused():
        assert wd._deadline == float("inf")


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("multiple", -1), ("first_step_s", float("nan")), ("exit_code", 0)])
def test_bad_watchdog_settings_are_clear_errors(field, value):
    with pytest.raises(ValueError, match=f"WatchdogConfig.{field}"):
        WatchdogConfig(**{field: value})


# ---------------------------------------------------------------------------------------------------------
# Drills
# ---------------------------------------------------------------------------------------------------------
def test_hang_kill_and_slow_parse_and_bad_forms_are_refused():
    assert Fault.parse("hang@5:1") == Fault("hang", 5, 1)
    assert Fault.parse("kill@3") == Fault("kill", 3, None)
    assert Fault.parse("slow@2:0=4") == Fault("slow", 2, 0, "4")
    for spec, message in (("slow@2=0.5", "factor >= 1"), ("slow@2=fast", "numeric factor"), ("kill@3=9", "takes no =ARG"),
                          ("freeze@3", "unknown kind")):
        with pytest.raises(ValueError, match=message):
            Fault.parse(spec)


def test_faults_that_can_never_fire_are_refused_naming_the_flag():
    validate_faults(["nan_batch@1:1", "kill@9"], world_size=2, max_steps=10)
    with pytest.raises(ValueError, match=r"--inject_fault 'nan_batch@1:7': rank 7 does not exist in a run of 1 process"):
        validate_faults(["nan_batch@1:7"], world_size=1, max_steps=10)
    with pytest.raises(ValueError, match=r"'hang@10': step 10 is past the end of the run"):
        validate_faults(["hang@10"], world_size=2, max_steps=10)


def test_the_trainer_refuses_a_fault_that_can_never_fire_before_building_anything(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(TRAIN), "--output_dir", str(out), "--inject_fault", "nan_batch@1:7"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "--inject_fault 'nan_batch@1:7': rank 7 does not exist in a run of 1 process" in proc.stderr
    assert not out.exists()


def test_slow_sleeps_its_factor_from_its_step_on_and_no_other_fault_fires_again_after_a_restart():
    faults = FaultInjector(["slow@2=3"], rank=0)
    assert faults.slow_down(1, 0.01) == 0.0
    assert faults.slow_down(2, 0.01) == pytest.approx(0.02)
    assert faults.slow_down(7, 0.01) == pytest.approx(0.02)  # a slow device stays slow
    restarted = FaultInjector(["slow@2=3", "kill@2", "hang@2"], rank=0, restart_count=1)
    restarted.maybe_kill(2)  # would SIGKILL this test process if it fired
    restarted.maybe_hang(2)
    assert restarted.slow_down(2, 0.01) == pytest.approx(0.02)  # but a slow device is still slow after a restart


# ---------------------------------------------------------------------------------------------------------
# Restart bookkeeping
# ---------------------------------------------------------------------------------------------------------
def test_launch_info_reads_the_elastic_agents_environment():
    info = LaunchInfo.from_env({"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "r"})
    assert info.is_restart and info.elastic and (info.restart_count, info.max_restarts, info.run_id) == (2, 3, "r")
    assert not LaunchInfo.from_env({}).is_restart and not LaunchInfo.from_env({}).elastic
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='x' is not an integer"):
        LaunchInfo.from_env({"TORCHELASTIC_RESTART_COUNT": "x"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning(
        {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    fresh_store = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert shared_store_warning({**fresh_store, "TORCHELASTIC_RUN_ID": "5f0c"}) is None  # PET_STANDALONE's own id
    # torch's default rendezvous on one machine, shared with any job launched the same way
    default = {**fresh_store, "TORCHELASTIC_RUN_ID": "none"}
    assert "PET_STANDALONE=1" in shared_store_warning({**default, "GROUP_WORLD_SIZE": "1"})
    assert shared_store_warning({**default, "GROUP_WORLD_SIZE": "2"}) is None  # nodes meet at their own endpoint
    assert shared_store_warning({**fresh_store, "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}) is None


def _attempt(run_dir, rank, last_words: str | None, **fields):
    log = EventLog(run_dir, rank)
    log.log("start", 0, world_size=2)
    log.log("metrics", 4, loss=1.0)
    if last_words:
        log.log(last_words, 5, **fields)
    log.close()


@pytest.mark.parametrize("rank0, rank1, cause, culprits", [
    (("crash", {"error": "RuntimeError: Connection closed by peer"}), (None, {}), "killed", [1]),
    # Rank 1 hung fetching data; rank 0 got to the guard's gather and waited for it there: only rank 1.
    (("hang", {"phase": "guard"}), ("hang", {"phase": "data"}), "hang", [1]),
    (("hang", {"phase": "data"}), ("hang", {"phase": "forward_backward"}), "hang", [0]),
    (("hang", {"phase": "data"}), ("hang", {"phase": "data"}), "hang", [0, 1]),  # cannot be told apart: both
    (("crash", {"error": "RuntimeError: boom"}), ("crash", {"error": "RuntimeError: boom"}), "exception", [0, 1]),
    (("stop", {"exit_code": 0}), ("stop", {"exit_code": 0}), "stopped", [0, 1]),
])
def test_the_previous_attempts_cause_comes_from_each_ranks_last_words(tmp_path, rank0, rank1, cause, culprits):
    for rank, (words, fields) in enumerate((rank0, rank1)):
        _attempt(tmp_path, rank, words, **fields)
    found = previous_attempt(tmp_path, before=time.time() + 1)
    assert found["cause"] == cause and found["culprit_ranks"] == culprits
    assert found["ranks"][0]["last_step"] == 5 and found["ranks"][1]["last_words"] == rank1[0]
    # Events written after this process started belong to the current attempt and are ignored.
    assert previous_attempt(tmp_path, before=0.0)["cause"] == "unknown"
