"""A pre-imported interpreter that forks one process per 1-process launch of the trainer by the tests
(tests/trainer_utils.py): a real process running it as ``__main__``, with its own
folder, streams, exit code and signals, without the seconds of imports (torch, diffusers, Accelerate) every
fresh interpreter pays again. It was started in the launches' own environment: what a library reads at import
is what a fresh process would read.

Requests, one JSON object per line on stdin: ``{"argv", "cwd", "env", "stdout", "stderr", "status"}``; the reply
is the child's pid on stdout. When the child ends, ``status`` gets ``{"returncode": N}`` (negative: the signal
that ended it, as ``subprocess.Popen.returncode``). End of stdin: this process exits.
"""

from __future__ import annotations

import json
import os
import select
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "warm_ranks"))
from warm_rank_fork import DIFFUSERS_RANK, EMA_RANK, EVERY_RANK, run_as_main  # noqa: E402  (one way to run and end a fork)

sys.path.pop()

PRELOAD = (*EVERY_RANK, *DIFFUSERS_RANK, *EMA_RANK, "diffusers.models.autoencoders.autoencoder_kl_wan", "av",
           "accelerate.logging", "vidstab.reference.model", "vidstab.reference.vae", "vidstab.reference.objective")


def _child(request: dict) -> None:
    """Become the launch: its folder, environment, standard streams and argv, then the script as ``__main__``."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    argv = list(request["argv"])  # what follows `python`: the script, then its arguments
    sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py`: its folder first
    os._exit(run_as_main(argv[0]))


def _write_status(path: str, returncode: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"returncode": returncode}, f)
    os.replace(tmp, path)


def main() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a fresh process would import it when needed; nothing is preloaded that is not installed
    running: dict[int, str] = {}  # pid -> its status file
    pending, ended = b"", False
    while not ended:
        if select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 16)
            ended = not chunk
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            running[pid] = request["status"]
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _write_status(running.pop(pid), os.waitstatus_to_exitcode(status))
    for pid, path in running.items():  # the tests are gone: wait for what is still running, then leave
        _write_status(path, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))


if __name__ == "__main__":
    main()
