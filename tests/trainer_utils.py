"""Run the reference trainer as a real subprocess (1 or 2 processes) and read what it leaves behind."""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

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


class _WarmLaunch:
    """A 1-process launch forked by tests/scripts/warm_start.py, read as ``subprocess.Popen`` is by this module."""

    def __init__(self, pid: int, status: Path):
        self.pid, self._status, self.returncode = pid, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = json.loads(self._status.read_text())["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_warm: dict = {}  # this test process's pre-imported interpreters, by the environment each was started in
MAX_WARM = 4  # about 0.5 GiB each


def _start_warm(cmd: list[str], env: dict, cwd: Path, folder: Path) -> tuple[_WarmLaunch, tuple]:
    """``cmd`` (``python`` and what follows) as a process forked from this test process's pre-imported interpreter
    for ``env`` (started on first use); (the launch, its stdout and stderr files, open for reading)."""
    # the environment a library may read at import: all of it but what pytest changes per test and what a launch
    # reads as it runs
    key = json.dumps({k: v for k, v in env.items() if k not in READ_AT_RUN_TIME}, sort_keys=True)
    server = _warm.pop(key, None)
    if server is None or server.poll() is not None:
        if len(_warm) >= MAX_WARM:  # the least recently used one ends once what it started has ended
            _warm.pop(next(iter(_warm))).stdin.close()
        script = Path(__file__).resolve().parent / "scripts" / "warm_start.py"
        server = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
    _warm[key] = server  # the most recently used last
    names = [folder / name for name in ("stdout", "stderr", "status")]
    for path in names[:2]:
        path.touch()
    request = {"argv": cmd[1:], "cwd": str(cwd), "env": env, "stdout": str(names[0]), "stderr": str(names[1]),
               "status": str(names[2])}
    server.stdin.write((json.dumps(request) + "\n").encode())
    server.stdin.flush()
    pid = int(server.stdout.readline())
    return _WarmLaunch(pid, names[2]), tuple(open(path, "rb") for path in names[:2])


READ_AT_RUN_TIME = ("PYTEST_CURRENT_TEST", "ACCELERATE_USE_CPU", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "PET_STANDALONE")
"""Variables no preloaded module reads at import (Accelerate and torch elastic read them as they start a launch):
launches that differ only in them share one pre-imported interpreter."""

WARM = os.environ.get("VIDSTAB_TEST_WARM_RANKS") == "1"
"""Whether launches start from a pre-imported interpreter: in the tests (tests/conftest.py), unless
``VIDSTAB_TEST_COLD_START=1``; benchmarks start every launch fresh."""


def warm_run(cmd: list[str], env: dict | None = None, cwd: str | Path | None = None,
             timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`` for
    ``python script.py ...`` or ``python -m module ...`` (a launcher: ``accelerate.commands.launch``,
    ``torch.distributed.run``), forked from a pre-imported interpreter (tests/scripts/warm_start.py); its ranks
    fork from it in turn (tests/warm_ranks). For launches run to their end and read from their output and files."""
    env = dict(os.environ if env is None else env)
    cwd = Path(os.getcwd() if cwd is None else cwd)
    if not WARM or cmd[0] != sys.executable or len(cmd) < 2 or (cmd[1].startswith("-") and cmd[1] != "-m"):
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    with tempfile.TemporaryDirectory(prefix="vidstab-launch-") as folder:
        launch, outs = _start_warm(cmd, env, cwd, Path(folder))
        try:
            return _finish(launch, cmd, outs, deadline, check=False)
        finally:
            for f in outs:
                f.close()


def run_trainer(output_dir: Path, *args: str, nproc: int = 1, timeout: float = 240, check: bool = True,
                env: dict | None = None, html_report: bool = False) -> subprocess.CompletedProcess:
    """Launch ``recipes/train.py`` like a user would; a hang fails the test instead of blocking CI."""
    return run_trainers((output_dir, *args), nproc=nproc, timeout=timeout, check=check, env=env, html_report=html_report)[0]


def run_trainers(*runs: tuple, nproc: int = 1, timeout: float = 240, check: bool = True,
                 env: dict | None = None, html_report: bool = False) -> list[subprocess.CompletedProcess]:
    """Launch independent trainer runs at once, each ``(output_dir, *args)`` as for :func:`run_trainer`.

    Runs that do not depend on each other (an uninterrupted reference and the first segment of a resumed
    run, or several bad-flag invocations) overlap their start-up (imports, data, VAE) on the CI's 2 cores;
    each is still its own real process with its own folder (and, with ``nproc > 1``, its own port).

    A launch in the tests' own environment (no ``env``) is forked from a pre-imported interpreter
    (tests/scripts/warm_start.py): the same script (or launcher, whose ranks fork from it) as ``__main__`` in its
    own process, without the seconds of imports each fresh interpreter pays; ``VIDSTAB_TEST_COLD_START=1``
    starts every launch fresh. The tests of the start-up itself (the README's and the docs' commands) start
    fresh."""
    started = []
    deadline = time.monotonic() + timeout
    launches = tempfile.TemporaryDirectory(prefix="vidstab-launch-")
    try:
        for i, (output_dir, *args) in enumerate(runs):
            cmd, full_env = _trainer_cmd(Path(output_dir), tuple(args), nproc, env, html_report)
            if env is None and WARM:
                folder = Path(launches.name) / str(i)
                folder.mkdir()
                launch, outs = _start_warm(cmd, full_env, REPO, folder)
                started.append((launch, cmd, outs))
                continue
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
        launches.cleanup()


# Rendezvous ports come from below the kernel's ephemeral range (32768-60999 on Linux), so no connection a
# concurrent launch opens (gloo, TCPStore clients) is ever given one; each is reserved with a lock file held
# for the life of this process, so no other test process (another xdist worker, another pytest session on
# the machine) hands out the same port while this one may still be using it.
PORT_RANGE = (20000, 32000)
PORT_LOCKS = Path(tempfile.gettempdir()) / "vidstab-test-ports"
_reserved: dict[int, int] = {}  # port -> fd of its lock file, open until this process exits


def free_port() -> int:
    """A rendezvous port on 127.0.0.1 no other launch uses: bindable now, outside the ephemeral range, and
    reserved for this process (torchrun's rendezvous with ``--master_port 0`` does not form here)."""
    PORT_LOCKS.mkdir(exist_ok=True)
    low, high = PORT_RANGE
    start = low + (os.getpid() * 7919 + len(_reserved) * 104729) % (high - low)
    for i in range(high - low):
        port = low + (start - low + i) % (high - low)
        if port in _reserved:
            continue
        fd = os.open(PORT_LOCKS / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                continue
        _reserved[port] = fd
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def shared_dir(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this test session sees (the session's base temp folder)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(where, name: str, build: Callable[[Path], object]) -> Path:
    """The folder ``name`` that ``build(folder)`` fills, built once per test session however the tests that
    read it are spread over xdist workers: the first worker builds it holding a lock, the others wait on
    that lock and reuse it. A build that failed is not retried by the others: they fail with its error.
    ``where``: pytest's ``tmp_path_factory`` (the session's folder), or a folder."""
    root = (Path(where) if isinstance(where, (str, os.PathLike)) else shared_dir(where)) / "shared-runs"
    root.mkdir(exist_ok=True)
    folder, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            raise AssertionError(f"the shared run {name} failed on another worker:\n{failed.read_text()[-6000:]}")
        if not done.exists():
            try:
                build(folder)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}")
                raise
            done.write_text("ok")
    return folder


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
