"""Two "nodes" with node-local checkpoint folders (``ProjectConfiguration(save_on_each_node=True)``).

Started by tests/test_checkpoint_sharded.py as two plain processes, each its own node (LOCAL_RANK 0,
LOCAL_WORLD_SIZE 1, so each is its node's local main process, as Accelerate keys ``is_local_main_process``)
with its own output folder: ``ckpt_node_local.py OUT_PREFIX KIND`` writes to ``OUT_PREFIX{RANK}``. KIND
``fsdp`` (sharded, DCP) or ``ddp`` (full state). Saves twice, perturbs the weights, loads ``latest`` and
prints ``RESTORED rank R step S`` when every parameter and the trainer state came back.
"""

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from tiny_model import two_layer_model
from vidstab.checkpoint import CheckpointConfig, CheckpointManager

prefix, kind = sys.argv[1:3]
out = f"{prefix}{os.environ['RANK']}"
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=out, save_on_each_node=True))
model = two_layer_model(acc, kind)
opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
ckpt = CheckpointManager(acc, out, CheckpointConfig(async_save=False))
ckpt.register("model", model)
ckpt.register("optimizer", opt)
for step in (1, 2):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(step, trainer_state={"step": step, "epoch": 0})


def local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


saved = [local(p) for p in model.parameters()]
saved_opt = [local(v) for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
with torch.no_grad():
    for p in model.parameters():
        p.mul_(0.0)
state = ckpt.load("latest")
ok = all(torch.equal(a, local(p)) for a, p in zip(saved, model.parameters()))
ok &= all(torch.equal(a, local(v)) for a, v in zip(saved_opt, [v for st in opt.optimizer.state.values()
                                                             for v in st.values() if torch.is_tensor(v)]))
print(f"{'RESTORED' if ok and state['step'] == 2 else 'DIFFERS'} rank {acc.process_index} step {state['step']}", flush=True)
