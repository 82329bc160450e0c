"""What a rank of the tests' launches sees of its own process, written to ``OUT/rank{R}.json``
(tests/test_warm_ranks.py compares a forked rank's with a fresh one's)."""

import faulthandler
import json
import logging
import os
import signal
import sys

preloaded = "torch" in sys.modules  # before this script imports anything: forked from a launcher that had
import torch  # noqa: E402

out = sys.argv[1]
rank = os.environ.get("RANK", "0")  # unset in a 1-process launch


def command(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().split("\0")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


# the launcher: started as one, or forked from the tests' pre-imported interpreter (its command line is that one's)
parent = command(os.getppid())
forked_launcher = any(p.endswith("warm_start.py") for p in parent) and \
    any(p.endswith("warm_start.py") for p in command(parent_of(os.getppid())))
seen = {
    "preloaded": preloaded,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path": [p for p in sys.path if "warm_ranks" not in p],
    # what differs from launch to launch: whether it is set
    "env": {k: v if k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE") else "set"
            for k, v in os.environ.items() if k not in ("VIDSTAB_TEST_WARM_RANKS", "PYTHONPATH")},
    "pythonpath": [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if "warm_ranks" not in p],
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
                if isinstance(s, signal.Signals)},
    "parent_is_the_launcher": "accelerate.commands.launch" in parent or forked_launcher,
    "session_leader": os.getsid(0) == os.getpid(),
    "threads": torch.get_num_threads(),
    "faulthandler": faulthandler.is_enabled(),
    "root_logger": [len(logging.root.handlers), logging.root.level],
    "excepthook": sys.excepthook is sys.__excepthook__,
    "main": [__name__, __file__],
    "stdout_write_through": sys.stdout.write_through,
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f, indent=1, sort_keys=True)
if "WORLD_SIZE" not in os.environ:
    raise ValueError("the probe's uncaught error")
torch.distributed.init_process_group("gloo")  # every rank: it installs torch's rank-prefixing excepthook
torch.distributed.barrier()
if rank == "1":
    raise ValueError("the probe's uncaught error")  # the interpreter prints it through that excepthook
torch.distributed.destroy_process_group()
