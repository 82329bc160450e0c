"""A data set without ids gets its indices as sample ids, and an incident bundle names the bad sample by them."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator

import vidstab


def test_indices_become_sample_ids_and_name_the_bad_sample_in_the_bundle(tmp_path):
    latents = torch.randn(8, 4)
    latents[5, 1] = float("nan")
    images = [{"latents": x} for x in latents]  # a data set of dicts without ids
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(vidstab.WithSampleIds(images), batch_size=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, opt, loader = acc.prepare(model, opt, loader)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    skipped = []
    for batch in loader:
        guard.backward(model(batch["latents"]).pow(2).mean(), batch={"latents": batch["latents"]},
                       sample_ids=batch["sample_ids"])
        result = guard.step(1.0)
        if result.skipped:
            skipped.append(result.incident)
    assert len(skipped) == 1
    meta = json.loads((skipped[0] / "incident.json").read_text())
    assert meta["bad_sample_ids"] == ["5"] and "5" in meta["sample_ids"]
    # tuples get the index appended; an id field that already exists is not overwritten silently
    assert vidstab.WithSampleIds(torch.utils.data.TensorDataset(latents))[3][1] == 3
    with pytest.raises(KeyError, match="already has a 'sample_ids' field"):
        vidstab.WithSampleIds([{"sample_ids": 1}])[0]
