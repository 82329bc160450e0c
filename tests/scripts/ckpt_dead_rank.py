"""A rank dies (SIGKILL) in the middle of a checkpoint save; the survivor must not wait for it.

Started by tests/test_checkpoint_sharded.py as two plain processes (RANK/WORLD_SIZE/MASTER_* in the
environment, no elastic agent that would kill the survivor for us). ``ckpt_dead_rank.py OUT MODE KIND``:
MODE ``async`` or ``sync``; KIND ``ddp`` (full-state layout) or ``fsdp`` (sharded, DCP). Rank 1 SIGKILLs
itself at its first file write of the second save (fault injection in ``os.write``). Rank 0 prints
``SURVIVOR: <error>`` and exits 3 when the save fails with CheckpointError.
"""

import os
import signal
import sys

import torch
from accelerate import Accelerator

from tiny_model import two_layer_model
from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager

out, mode, kind = sys.argv[1:4]
acc = Accelerator(cpu=True)
model = two_layer_model(acc, kind)
ckpt = CheckpointManager(acc, out, CheckpointConfig(async_save=mode == "async"))
ckpt.register("model", model)
ckpt.save(1, trainer_state={"step": 1})
ckpt.wait()

if acc.process_index == 1:
    _real_write = os.write

    def dying_write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if "/.tmp-step_000002" in name:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return _real_write(fd, data)

    os.write = dying_write
try:
    ckpt.save(2, trainer_state={"step": 2})
    ckpt.wait()
except CheckpointError as e:
    print(f"SURVIVOR rank {acc.process_index}: {e}", flush=True)
    os._exit(3)  # the process group is broken: do not run its shutdown
print(f"rank {acc.process_index}: save 2 succeeded although rank 1 died", flush=True)
sys.exit(1)
