"""Two processes: rank 1 stalls between creating a file and writing its bytes (run with
`accelerate launch --multi_gpu --num_processes 2`).

Fault injection in a dependency, not in the checkpoint manager: on rank 1 only, ``os.write`` sleeps
before writing to any file whose name contains ``.rank1.done`` -- a process descheduled right after
``open(O_CREAT)``. The main process polls for that marker; if it can see the file before its bytes are
there it parses an empty file. Every save must succeed and load back. Prints "OK rank R" on success.
"""

import os
import sys
import time

import torch
from accelerate import Accelerator

from vidstab.checkpoint import CheckpointConfig, CheckpointManager

acc = Accelerator(cpu=True)
if acc.process_index == 1:
    _real_write = os.write
    stalls = []

    def stalling_write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if ".rank1.done" in os.path.basename(name) and fd not in stalls:
            stalls.append(fd)
            time.sleep(0.5)  # created, still empty: what a descheduled process leaves visible
        return _real_write(fd, data)

    os.write = stalling_write

torch.manual_seed(0)
model = acc.prepare(torch.nn.Linear(8, 8))
for mode in ("sync", "async"):
    ckpt = CheckpointManager(acc, os.path.join(sys.argv[1], mode), CheckpointConfig(async_save=mode == "async"))
    ckpt.register("model", model)
    for step in (1, 2):
        ckpt.save(step, trainer_state={"step": step})
    ckpt.wait()
    assert ckpt.load("latest")["step"] == 2
    if acc.process_index == 1:
        assert stalls, "the stall was never injected (marker written some other way?)"
    print(f"OK rank {acc.process_index} {mode}", flush=True)
acc.end_training()
