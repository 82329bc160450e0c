"""Preflight audit: each check flags what it should (naming the samples/modules/lines) and passes clean input."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from vidstab.tools.audit import (
    AuditReport,
    audit_before_training,
    audit_latent_cache,
    audit_loss_source,
    audit_model,
    audit_tensors,
    audit_training_config,
    run_audit,
)


def clean_latents(n: int = 16, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Normalised latents [C, F, H, W] ~ N(0, 1) with moving content (frames differ)."""
    g = torch.Generator().manual_seed(seed)
    return [(f"clip-{i:03d}", torch.randn(4, 3, 8, 8, generator=g)) for i in range(n)]


def by_check(findings: list[dict]) -> dict[str, dict]:
    return {f["check"]: f for f in findings}


def test_poisoned_huge_and_constant_samples_are_named():
    samples = clean_latents()
    poisoned = samples[2][1].clone()
    poisoned[0, 1, 2, 3] = float("nan")
    samples[2] = ("poisoned", poisoned)
    samples[5] = ("huge", samples[5][1] * 1e4)
    samples[9] = ("blank", torch.zeros(4, 3, 8, 8))

    findings = by_check(audit_tensors(samples, name="latents"))
    assert findings["latents.nonfinite"]["severity"] == "block"
    assert findings["latents.nonfinite"]["details"]["sample_ids"] == ["poisoned"]
    assert "poisoned" in findings["latents.nonfinite"]["message"]
    assert findings["latents.extreme"]["severity"] == "block"
    assert findings["latents.extreme"]["details"]["sample_ids"] == ["huge"]
    assert findings["latents.constant"]["severity"] == "warn"
    assert findings["latents.constant"]["details"]["sample_ids"] == ["blank"]
    assert AuditReport(list(findings.values())).blocking


def test_clean_latents_pass_with_range_percentiles():
    findings = audit_tensors(clean_latents(), name="latents")
    assert [f["severity"] for f in findings] == ["info"]
    stats = findings[0]["details"]
    assert stats["num_samples"] == 16
    p = stats["percentiles"]
    assert -4.5 < p["p0.1"] < -2.0 and abs(p["p50"]) < 0.1 and 2.0 < p["p99.9"] < 4.5


def test_frozen_clip_and_outlier_are_warned():
    samples = clean_latents(24)
    still = torch.randn(4, 1, 8, 8).expand(4, 3, 8, 8).clone()  # one frame repeated
    samples[0] = ("still", still)
    samples[1] = ("loud", samples[1][1] * 4)  # within the absmax limit, but unlike the others
    findings = by_check(audit_tensors(samples, name="latents"))
    assert findings["latents.frozen"]["details"]["sample_ids"] == ["still"]
    assert "loud" in findings["latents.outliers"]["details"]["sample_ids"]
    assert not AuditReport(list(findings.values())).blocking


def test_latent_cache_folder_is_read_with_manifest_ids(tmp_path):
    # The layout vidstab.reference.vae writes: shards with a `latents` tensor, ids in manifest.json.
    samples = clean_latents(6)
    bad = samples[4][1].clone()
    bad[0, 0, 0, 0] = float("inf")
    tensors = [t for _, t in samples[:4]] + [bad, samples[5][1]]
    ids = [f"video-{i}.mp4" for i in range(6)]
    save_file({"latents": torch.stack(tensors[:3])}, str(tmp_path / "latents-00000.safetensors"))
    save_file({"latents": torch.stack(tensors[3:])}, str(tmp_path / "latents-00001.safetensors"))
    manifest = {"sample_ids": ids, "latent_shape": [4, 3, 8, 8], "shards": [
        {"file": "latents-00000.safetensors", "num_samples": 3},
        {"file": "latents-00001.safetensors", "num_samples": 3},
    ]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    findings = by_check(audit_latent_cache(tmp_path))
    assert findings["latents.nonfinite"]["details"]["sample_ids"] == ["video-4.mp4"]
    assert findings["latents.stats"]["details"]["num_samples"] == 6


def test_missing_cache_is_a_blocking_finding(tmp_path):
    findings = audit_latent_cache(tmp_path / "nope")
    assert findings[0]["check"] == "latents.read" and findings[0]["severity"] == "block"


class ManualAttention(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


class SdpaAttention(ManualAttention):
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v)


class Block(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.attn = attn

    def forward(self, x):
        return x + self.attn(self.proj(x))


def test_manual_softmax_attention_is_flagged_and_sdpa_passes():
    x = (torch.randn(1, 10, 16),)
    manual = by_check(audit_model(Block(ManualAttention()), x))
    assert manual["model.attention"]["severity"] == "warn"
    assert manual["model.attention"]["details"]["module"] == "attn (ManualAttention)"

    sdpa = audit_model(Block(SdpaAttention()), x)
    assert not [f for f in sdpa if f["severity"] != "info"]
    assert by_check(sdpa)["model.sdpa"]["details"]["sdpa_calls"] == {"attn (SdpaAttention)": 1}
    # The hooks and patches are gone afterwards.
    assert F.softmax.__name__ == "softmax" and torch.Tensor.softmax.__name__ == "softmax"


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def test_activation_limits_depend_on_precision_and_nonfinite_blocks():
    x = (torch.ones(2, 8),)
    # fp32/bf16 limit 1e4 (a sign of trouble ahead), fp16 limit 3e4 (half-way to fp16's max of 65504).
    fp32 = by_check(audit_model(nn.Sequential(Scale(2e4)), x, precision="no"))
    assert fp32["model.activations"]["severity"] == "warn"
    assert fp32["model.activations"]["details"]["modules"]["0 (Scale)"] == 2e4
    assert "model.activations" not in by_check(audit_model(nn.Sequential(Scale(2e4)), x, precision="fp16"))
    assert "model.activations" in by_check(audit_model(nn.Sequential(Scale(5e4)), x, precision="fp16"))

    broken = nn.Sequential(nn.Linear(8, 8), Scale(float("inf")), nn.Linear(8, 8))
    found = by_check(audit_model(broken, x))
    assert found["model.nonfinite"]["severity"] == "block"
    assert found["model.nonfinite"]["details"]["modules"][0] == "1 (Scale)"


def test_config_checks():
    bad = by_check(audit_training_config({
        "learning_rate": 3e-3, "lr_warmup_steps": 0, "mixed_precision": "fp16", "grad_scaler": False,
        "prediction_type": "epsilon",
    }))
    assert bad["config.warmup"]["severity"] == "warn"
    assert bad["config.fp16_scaling"]["severity"] == "block"
    assert bad["config.lr"]["severity"] == "warn"
    assert bad["config.grad_clip"]["severity"] == "warn"

    good = audit_training_config({
        "optimizer": {"name": "adamw", "learning_rate": 1e-4}, "lr_warmup_steps": 500, "mixed_precision": "bf16",
        "max_grad_norm": 1.0, "prediction_type": "flow_matching",
    })
    assert [f for f in good if f["severity"] != "info"] == []
    unknown = by_check(audit_training_config({"prediction_type": "eps", "lr_warmup_steps": 10, "max_grad_norm": 1}))
    assert unknown["config.prediction_type"]["severity"] == "block"


def risky_loss(pred, target, weight):
    ratio = pred / target
    return torch.log(ratio).mean() + weight.sqrt().mean()


def safe_loss(pred, target, weight, eps: float = 1e-6):
    """Guarded: log(x) and division by x with an epsilon; division by a literal is fine."""
    ratio = pred / (target.abs() + eps)
    return torch.log(ratio.clamp_min(1e-8)).mean() / 2 + torch.log1p(weight).mean()


def test_loss_source_scan():
    findings = audit_loss_source(risky_loss)
    warned = [f["details"]["code"] for f in findings if f["severity"] == "warn"]
    assert warned == ["ratio = pred / target", "return torch.log(ratio).mean() + weight.sqrt().mean()"]
    assert all("epsilon" in f["message"] and "heuristic" in f["message"] for f in findings)
    assert [f["severity"] for f in audit_loss_source(safe_loss)] == ["info"]


def test_audit_before_training_with_the_reference_model():
    from vidstab.reference.model import VideoDiT

    model = VideoDiT(in_channels=4, hidden_size=48, num_layers=1, num_heads=4, attention_type="factorized")
    latents = torch.randn(3, 4, 2, 8, 8)
    latents[1] *= 1e4
    t = torch.tensor([10, 500])
    report = audit_before_training(
        model, latents, ["a", "b", "c"],
        {"lr_warmup_steps": 100, "max_grad_norm": 1.0, "learning_rate": 1e-4, "mixed_precision": "no"},
        dry_run_fn=lambda: model(latents[[0, 2]], t),
    )
    assert [f["check"] for f in report.blocking] == ["latents.extreme"]
    assert report.blocking[0]["details"]["sample_ids"] == ["b"]
    assert not [f for f in report.findings if f["check"] == "model.attention"]  # VideoDiT uses SDPA
    assert json.loads(report.to_json())["ok"] is False
    assert "BLOCKED" in report.format_table()


def _write_video(path, frames) -> None:
    """Encode uint8 RGB frames [T, H, W, 3] into a real MPEG-4 file with PyAV."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "1"}
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_folder_audit_names_broken_and_blank_files(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(3):
        _write_video(tmp_path / f"moving-{i}.mp4", rng.integers(0, 255, (6, 16, 16, 3), dtype=np.uint8))
    _write_video(tmp_path / "blank.mp4", np.full((6, 16, 16, 3), 128, dtype=np.uint8))
    (tmp_path / "broken.mp4").write_bytes(b"definitely not a video")

    from functools import partial

    from vidstab.reference.data import video_folder_dataset

    # The audit decodes with the reader it is given (it imports no trainer code): here the reference loader's.
    reader = partial(video_folder_dataset, skip_bad_samples=True)
    report = run_audit(data_dir=tmp_path, video_reader=reader, num_frames=4, resolution=16)
    found = by_check(report.findings)
    assert not report.ok
    assert found["data.decode"]["severity"] == "block"
    assert found["data.decode"]["details"]["sample_ids"] == ["broken.mp4"]
    assert found["data.constant"]["details"]["sample_ids"] == ["blank.mp4"]
    assert found["data.stats"]["details"]["num_samples"] == 4

