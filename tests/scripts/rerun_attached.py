"""Launched by tests/test_rerun_attached.py (1 or 2 CPU processes): the README's attached form with a diffusers
``UNet2DModel`` built from its config, over a data set with one NaN sample, plus the line
``loader = guard.track_samples(loader)``. No replay function, no sample ids in the loop. The drill's own faults,
on the last rank: one activation corrupted once (``flaky_activation``) at ``--flaky_step``; a layer whose output is
+inf for the whole of ``--sick_step`` (``inf_module``: a faulty device, which a peer does not reproduce).

``--run OUT:first`` trains 2 epochs in OUT and saves with ``accelerator.save_state``; ``--run OUT:resume`` (a new
process) loads it and trains one more epoch; ``--run OUT:fsdp`` trains 2 epochs with the model sharded by hand with
FSDP2 ``fully_shard`` (Accelerate refuses FSDP on CPU; only the optimizer, loader and scheduler prepared). Several
``--run`` share one launch, one after another. Each rank writes ``OUT/seen-rank{R}-{PHASE}.json``: per epoch the
indices it trained on, and per batch whether the ids the guard took match the batch's own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from diffusers import UNet2DModel

import vidstab
from vidstab.faults import add_flaky_activation, add_module_fault

BAD = 5
N = 16


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(i))
        if i == BAD:
            x[0, 2, 2] = float("nan")  # a broken image in the data set itself
        return {"images": x, "index": i}  # "index": the drill's own bookkeeping, unknown to vidstab


def tiny_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="OUT:first|resume|fsdp")
    ap.add_argument("--flaky_step", type=int, default=-1)
    ap.add_argument("--sick_step", type=int, default=-1)
    args = ap.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    for spec in args.run:
        out, phase = spec.rsplit(":", 1)
        run(accelerator, out, phase, args.flaky_step, args.sick_step if phase == "first" else -1)


def run(accelerator: Accelerator, out: str, phase: str, flaky_step: int, sick_step: int = -1) -> None:
    model = tiny_unet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Images(), batch_size=2, shuffle=True)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    if phase == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (accelerator.num_processes,))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    else:
        model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=out)
    loader = guard.track_samples(loader)
    first_epoch = 0
    if phase == "resume":
        accelerator.load_state(str(Path(out, "checkpoint")))
        first_epoch = 2
    seen: dict[int, list[int]] = {}
    ids_match = []
    sick = None
    for epoch in range(first_epoch, first_epoch + (1 if phase == "resume" else 2)):
        for batch in loader:
            seen.setdefault(epoch, []).extend(int(i) for i in batch["index"])
            ids_match.append(guard.patches.sample_ids == [str(int(i)) for i in batch["index"]])
            last_rank = accelerator.process_index == accelerator.num_processes - 1
            first_micro_step = len(ids_match) % 2 == 1
            flaky = add_flaky_activation(model) if guard.global_step == flaky_step and last_rank and first_micro_step else None
            if guard.global_step == sick_step and last_rank and first_micro_step:
                sick = add_module_fault(accelerator.unwrap_model(model), "conv_in")
            with accelerator.accumulate(model):
                noise = torch.randn_like(batch["images"])
                timesteps = torch.randint(0, 1000, (batch["images"].shape[0],))
                pred = model(batch["images"] + noise, timesteps, return_dict=False)[0]
                loss = torch.nn.functional.mse_loss(pred, noise)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if flaky is not None:
                flaky.remove()
            if sick is not None and accelerator.sync_gradients:  # the step is over (its rerun included)
                sick = sick.remove()
    if phase == "first":
        accelerator.save_state(str(Path(out, "checkpoint")))
    Path(out, f"seen-rank{accelerator.process_index}-{phase}.json").write_text(
        json.dumps({"seen": seen, "ids_match": ids_match}))
    guard.close()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
