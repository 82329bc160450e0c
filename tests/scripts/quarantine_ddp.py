"""Launched by tests/test_quarantine.py on 2 CPU processes: a user's loop over a data set with one bad sample
(NaN latents), wrapped in ``vidstab.WithSampleIds`` and ``vidstab.QuarantinedDataset``. Each rank writes
``seen-rank{R}-{PHASE}.json``: per epoch, the sample ids it trained on. ``--phase resume`` loads the newest
checkpoint first (a new process: the quarantine list is all it knows of the bad sample)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointManager

BAD = 13


class Clips(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 2, 4, 4, generator=g)
        if i == BAD:
            x[0, 0, 0, 0] = float("nan")  # a broken clip in the data set itself
        return {"latents": x}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=("first", "resume"), required=True)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Conv3d(4, 4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = vidstab.QuarantinedDataset(vidstab.WithSampleIds(Clips()), args.out)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    guard = vidstab.attach(acc, model, optimizer, run_dir=args.out)
    ckpt = CheckpointManager(acc, args.out, CheckpointConfig(async_save=False))
    for name, obj in (("model", model), ("optimizer", optimizer), ("vidstab", guard)):
        ckpt.register(name, obj)
    first_epoch = 0
    if args.phase == "resume":
        state = ckpt.load("latest")
        first_epoch = int(state["epoch"])
        guard.global_step = int(state["step"])
    seen: dict[int, list[int]] = {}
    for epoch in range(first_epoch, first_epoch + args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.setdefault(epoch, []).extend(int(i) for i in batch["sample_ids"])
            loss = (model(batch["latents"]) - batch["latents"]).pow(2).mean()
            guard.backward(loss, batch={"latents": batch["latents"]}, sample_ids=batch["sample_ids"])
            guard.step(1.0)
    ckpt.save(guard.global_step, healthy=True, trainer_state={"step": guard.global_step, "epoch": first_epoch + args.epochs})
    ckpt.wait()
    Path(args.out, f"seen-rank{acc.process_index}-{args.phase}.json").write_text(json.dumps(seen))
    guard.close()
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
