"""Node-local checkpoint folders out of step: rank R reads ``OUT/node{R}`` (run with `accelerate launch
--multi_gpu --num_processes 2`). The test wrote the same step into both folders, but with different guard
statistics (what a stale copy on another node's disk gives). ``ckpt_replicas.py OUT``: with ``repair``
(the default) every rank ends with rank 0's state and says it was repaired; with ``refuse``
CheckpointError on every rank naming the object. Prints "OK rank R MODE" for each.
"""

import os
import sys

import torch
from accelerate import Accelerator

from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_checkpoint import GuardStandIn  # noqa: E402

out = sys.argv[1]
acc = Accelerator(cpu=True)
model = acc.prepare(torch.nn.Linear(4, 4))
for mode in ("repair", "refuse"):
    guard = GuardStandIn()
    ckpt = CheckpointManager(acc, os.path.join(out, f"node{acc.process_index}"),
                             CheckpointConfig(on_replica_mismatch=mode, remove_stale=False,
                                              # the folders were written by 1 process each (the node-local copies)
                                              allow_world_size_change=True))
    ckpt.register("model", model)
    ckpt.register("vidstab", guard)
    if mode == "repair":
        state = ckpt.load("latest")
        assert guard.state["lr_multiplier"] == 0.25, guard.state  # rank 0's copy, on every rank
        assert state["_checkpoint"]["repaired_from_rank0"] == ["vidstab"], state
        assert state["step"] == 2
    else:
        try:
            ckpt.load("latest")
            raise SystemExit("expected CheckpointError")
        except CheckpointError as e:
            assert "'vidstab' differs between rank 0 and rank(s) [1]" in str(e), e
    print(f"OK rank {acc.process_index} {mode}", flush=True)
acc.end_training()
