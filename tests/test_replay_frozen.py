"""Replay of frozen-base checkpoints: a LoRA fine-tune's checkpoint holds only the adapters
and a fingerprint of the frozen base; `vidstab replay` rebuilds the base from the recorded factory, loads the
adapters over it, verifies the fingerprint, reproduces the incident and names the sample. A factory that
builds another base is refused, naming the fingerprints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))

from replay_user_model import make_batch, make_lora_model, video_mse  # noqa: E402

import vidstab  # noqa: E402
from vidstab.checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402
from vidstab.recovery.quarantine import QuarantineList  # noqa: E402
from vidstab.tools.replay import ReplayError, replay  # noqa: E402

SPEC = {"factory": "replay_user_model:make_lora_model", "kwargs": {"channels": 4, "hidden": 16, "rank": 2},
        "loss_fn": "replay_user_model:video_mse"}


def _lora_run(run_dir: Path) -> Path:
    """A user's LoRA loop: a checkpoint at step 3, a NaN clip ("clip-1") in the batch of step 5."""
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = make_lora_model(**SPEC["kwargs"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    # Capture does not quarantine here, so the test sees replay's leave-one-out do it.
    guard = vidstab.attach(acc, model, opt, run_dir=run_dir, model_spec=SPEC, seed=0,
                           config=vidstab.GuardConfig(quarantine_bad_samples=False))
    ckpt = CheckpointManager(acc, str(run_dir), CheckpointConfig(async_save=False))
    for name, obj in (("model", model), ("optimizer", opt), ("vidstab", guard)):
        ckpt.register(name, obj)
    guard.checkpoint_fn = ckpt.latest_path_str
    for step in range(7):
        batch = make_batch(batch_size=3, seed=step)
        if step == 5:
            batch["latents"][1, 0, 0, 0, 0] = float("nan")
        loss = video_mse(model, batch).mean()
        guard.backward(loss, batch=batch, sample_ids=["clip-0", "clip-1", "clip-2"])
        result = guard.step(1.0)
        if step == 5:
            assert result.skipped and result.incident is not None
            bundle = result.incident
        if step == 2:
            ckpt.save(3, healthy=True, trainer_state={"step": 3})
    guard.close()
    return Path(bundle)


def test_replay_of_a_lora_checkpoint_rebuilds_the_base_verifies_it_and_names_the_sample(tmp_path):
    bundle = _lora_run(tmp_path)
    weights = tmp_path / "vidstab" / "checkpoints" / "step_000003" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        assert all("lora_" in k for k in f.keys())  # only the adapters were saved
        assert "vidstab_frozen" in f.metadata()
    report = replay(bundle, trust=["replay_user_model"])
    assert report.reproduced is True
    d = report.to_dict()
    assert d["data"]["culprits"] == ["clip-1"]
    assert any("frozen-base checkpoint" in n and "match the recorded fingerprint" in n for n in d["notes"])
    # The sample leave-one-out named goes into the run's quarantine list.
    entries = {e["sample_id"]: e for e in QuarantineList(tmp_path).entries()}
    assert set(entries) == {"clip-1"} and entries["clip-1"]["source"] == "replay"


def test_replay_refuses_a_factory_that_builds_another_base(tmp_path):
    bundle = _lora_run(tmp_path)
    meta_path = bundle / "incident.json"
    meta = json.loads(meta_path.read_text())
    meta["model"]["kwargs"]["base_seed"] = 99  # the factory now loads another "pretrained" base
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ReplayError, match="not the one the run trained on: its 6 frozen tensors fingerprint"):
        replay(bundle, trust=["replay_user_model"])
