"""Incident bundles: atomic write, bitwise round-trip, strict JSON, clear errors on bad bundles."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))

from replay_user_model import make_batch, make_model, video_mse  # noqa: E402

from vidstab.evidence.capture import (  # noqa: E402
    IncidentError,
    json_float,
    list_incidents,
    read_incident,
    write_incident,
)
from vidstab.evidence.localize import locate_nonfinite  # noqa: E402

SPEC = {
    "factory": "replay_user_model:make_model",
    "kwargs": {"channels": 4, "hidden": 16},
    "loss_fn": "replay_user_model:video_mse",
    "loss_fn_kwargs": {"noise_scale": 1.0},
}
FINDING = {"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN on rank 0",
           "figures": {"grad_norm": float("nan"), "loss": float("inf"), "threshold": 3.5}}


def _write(run_dir: Path, batch=None, **kw):
    args = dict(step=12, micro_step=0, rank=0, world_size=1, batch=batch if batch is not None else make_batch(),
                sample_ids=["clip-0", "clip-1", "clip-2"], finding=FINDING, lr=1e-4, precision="no", seed=3,
                checkpoint=run_dir / "checkpoints" / "step_000010", model_spec=SPEC)
    args.update(kw)
    return write_incident(run_dir, **args)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_round_trip_is_bitwise_and_never_pickles(tmp_path):
    base = torch.randn(3, 4, 6)
    batch = {
        "latents": base[:, :, ::2],  # a non-contiguous view
        "noise": torch.randn(3, 4, 3, requires_grad=True),  # a tensor that requires grad
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "timesteps": torch.tensor([0, 999, 500]),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
    }
    batch["latents"][0, 0, 0] = float("nan")
    batch["half"][2, 1] = float("-inf")
    bundle = _write(tmp_path, batch=batch)

    assert bundle == tmp_path / "vidstab" / "incidents" / "step000012-rank0"
    assert sorted(p.name for p in bundle.iterdir()) == ["batch.safetensors", "incident.json"]
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".tmp")]
    # safetensors holds only raw tensor bytes + a JSON header: there is no pickle to load.
    with safe_open(str(bundle / "batch.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(batch)

    inc = read_incident(bundle)
    for k, v in batch.items():
        got = inc.tensors[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert _bits(got) == _bits(v.detach()), k
    # Strict JSON: no NaN/Infinity literals anywhere, non-finite figures spelled as strings.
    text = (bundle / "incident.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert inc.meta["figures"] == {"grad_norm": "nan", "loss": "inf", "threshold": 3.5}
    assert json_float(inc.meta["figures"]["loss"]) == float("inf")


def test_incident_json_records_contract_fields(tmp_path):
    batch = make_batch()
    batch["latents"][1, 2] = float("nan")
    batch["noise"][2] *= 1e4  # an absmax outlier with finite values
    bundle = _write(tmp_path, batch=batch, extra={"optimizer": "AdamW"})
    meta = read_incident(bundle).meta

    assert meta["schema"] == 1
    assert (meta["step"], meta["micro_step"], meta["rank"], meta["world_size"]) == (12, 0, 0, 1)
    assert meta["sample_ids"] == ["clip-0", "clip-1", "clip-2"]
    assert meta["bad_sample_ids"] == ["clip-1", "clip-2"]
    assert "latents" in meta["bad_reasons"]["clip-1"][0] and "non-finite" in meta["bad_reasons"]["clip-1"][0]
    assert "noise: absmax" in meta["bad_reasons"]["clip-2"][0]
    assert meta["sample_stats"][1]["tensors"]["latents"]["nan"] == 32
    assert meta["sample_stats"][0]["tensors"]["latents"]["nonfinite"] == 0
    assert (meta["detector"], meta["verdict"], meta["message"]) == ("nonfinite", "SKIP", "loss is NaN on rank 0")
    assert meta["checkpoint"] == "checkpoints/step_000010"  # relative to the run folder
    assert meta["model"] == {"factory": "replay_user_model:make_model", "kwargs": {"channels": 4, "hidden": 16}}
    assert meta["loss"] == {"fn": "replay_user_model:video_mse", "kwargs": {"noise_scale": 1.0}}
    assert meta["objective"] == {"noise_scale": 1.0}
    assert (meta["lr"], meta["precision"], meta["seed"]) == (1e-4, "no", 3)
    assert meta["tensors"] == ["latents", "noise", "timesteps"]
    assert set(meta["versions"]) >= {"torch", "accelerate", "vidstab"}
    assert meta["extra"] == {"optimizer": "AdamW"}


def test_localization_from_a_real_failure_is_stored(tmp_path):
    model = make_model(blowup=1e39)
    batch = make_batch()
    loc = locate_nonfinite(model, lambda: video_mse(model, batch))
    bundle = _write(tmp_path, batch=batch, localization=loc)
    meta = read_incident(bundle).meta
    assert meta["localization"]["forward"]["module"] == "blowup"
    assert meta["localization"]["loss_finite"] is False


def test_finding_object_and_names_micro_step_and_repeat(tmp_path):
    from vidstab.detectors import base
    finding = base.Finding("grad_spike", base.Verdict.ROLLBACK, "norm 40x EMA", {"ratio": 40.0, "grad_norm": float("inf")})
    a = _write(tmp_path, finding=finding, micro_step=2, rank=1)
    b = _write(tmp_path, finding=finding, micro_step=2, rank=1)  # the same step failing again after a rollback
    c = _write(tmp_path, step=3, checkpoint=None, model_spec=None)
    assert a.name == "step000012-rank1-m2" and b.name == "step000012-rank1-m2-2"
    meta = read_incident(a).meta
    assert meta["verdict"] == "ROLLBACK" and meta["figures"]["grad_norm"] == "inf"
    assert read_incident(c).meta["model"] is None and read_incident(c).meta["checkpoint"] is None
    assert list_incidents(tmp_path) == [c, a, b]
    assert list_incidents(tmp_path / "nowhere") == []


def test_read_names_missing_or_corrupt_batch_file(tmp_path):
    bundle = _write(tmp_path)
    batch_file = bundle / "batch.safetensors"
    data = batch_file.read_bytes()
    batch_file.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(IncidentError, match=r"batch\.safetensors is corrupt or truncated"):
        read_incident(bundle)
    batch_file.write_bytes(b"\x00" * 5)  # garbage
    with pytest.raises(IncidentError, match=r"batch\.safetensors"):
        read_incident(bundle)
    batch_file.unlink()
    with pytest.raises(IncidentError, match=r"batch\.safetensors is missing"):
        read_incident(bundle)


def test_read_names_missing_or_corrupt_metadata(tmp_path):
    bundle = _write(tmp_path)
    meta_file = bundle / "incident.json"
    meta = json.loads(meta_file.read_text())
    del meta["sample_ids"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(IncidentError, match=r"lacks required field\(s\) \['sample_ids'\]"):
        read_incident(bundle)
    meta_file.write_text('{"schema": 1, "step": ')
    with pytest.raises(IncidentError, match=r"incident\.json is corrupt"):
        read_incident(bundle / "incident.json")
    meta_file.unlink()
    with pytest.raises(IncidentError, match=r"incident\.json is missing"):
        read_incident(bundle)
    with pytest.raises(IncidentError, match="does not exist"):
        read_incident(tmp_path / "no-such-bundle")


def test_model_spec_without_class_or_factory_is_rejected_before_writing(tmp_path):
    with pytest.raises(ValueError, match="'class'"):
        _write(tmp_path, model_spec={"loss_fn": "m:f"})
    assert list_incidents(tmp_path) == []
