"""A pre-imported interpreter that forks one process per launch by the tests (tests/trainer_utils.py: the trainer,
or a launcher, ``python -m accelerate.commands.launch`` / ``torch.distributed.run``, whose ranks fork from it in
turn: tests/warm_ranks): a real process running its script or module as ``__main__``, with its own
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
from warm_rank_fork import DEEPSPEED_RANK, DIFFUSERS_RANK, EMA_RANK, EVERY_RANK, become  # noqa: E402  (one way to fork)

sys.path.pop()

PRELOAD = (*EVERY_RANK, *DIFFUSERS_RANK, *EMA_RANK, *DEEPSPEED_RANK, "diffusers.models.autoencoders.autoencoder_kl_wan",
           "av", "accelerate.logging", "accelerate.commands.launch", "vidstab.reference.model", "vidstab.reference.vae",
           "vidstab.reference.objective")
"""The launches' imports, the launchers' too (``-m accelerate.commands.launch``, whose ranks fork from it). A
variable a module sets in the environment at import (DeepSpeed's default for torch's CUDA check) stays the
launch's own: unset, as in a fresh process that has not imported it (a check of CUDA that no CPU run makes)."""


def _child(request: dict) -> None:
    """Become the launch: its folder, environment, standard streams, argv and signals as a fresh interpreter's,
    then its script or module as ``__main__`` (tests/warm_ranks: what a forked rank becomes)."""
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out, err = (os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr"))
    become(request["argv"], request["env"], out, err, new_session=False,
           unbuffered=bool(request["env"].get("PYTHONUNBUFFERED")))


def _write_status(path: str, returncode: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"returncode": returncode}, f)
    os.replace(tmp, path)


def main() -> None:
    import importlib

    replies = os.fdopen(os.dup(1), "w")  # the pids; what an import prints (DeepSpeed logs to stdout) goes to stderr
    os.dup2(2, 1)
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
            replies.write(f"{pid}\n")
            replies.flush()
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _write_status(running.pop(pid), os.waitstatus_to_exitcode(status))
    for pid, path in running.items():  # the tests are gone: wait for what is still running, then leave
        _write_status(path, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))


if __name__ == "__main__":
    main()
