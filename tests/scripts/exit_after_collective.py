"""A 2-process gloo script that all-gathers a view of a tensor, drops its last Python reference and ends:
without vidstab's exit fence it ends in std::terminate (SIGABRT) in about 3 runs of 10 on a 2-core machine
(see vidstab/run/exit_fence.py). ``--fence`` registers the fence, as the guard and checkpoint manager do."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if "--fence" in sys.argv:
    from vidstab.run.exit_fence import register_exit_fence

    register_exit_fence()
torch.set_grad_enabled(False)
x = torch.randn(64, requires_grad=True)
view = x[16:48]  # a differentiable view, as FSDP2's parameter shards are
out = torch.empty(64)
dist.all_gather_into_tensor(out, view)
del view  # the gloo worker may now hold the view's last reference, and frees it after waking us
