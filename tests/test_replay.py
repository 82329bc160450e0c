"""Replay of real incident bundles: reproduction, localisation, triage, and clear failures (exit code 2)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

TESTS = Path(__file__).parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))

from replay_user_model import make_batch, make_model, video_mse  # noqa: E402

from vidstab.evidence.capture import write_incident  # noqa: E402
from vidstab.tools.replay import ReplayReport, main, replay  # noqa: E402

USER_SPEC = {
    "factory": "replay_user_model:make_model",
    "kwargs": {"channels": 4, "hidden": 16},
    "loss_fn": "replay_user_model:video_mse",
    "loss_fn_kwargs": {"noise_scale": 1.0},
}
# The user's own model module: replay imports it only when the user trusts it (vidstab.tools.trusted_import).
TRUST = ["replay_user_model"]
TRUST_ARGS = ("--trust", "replay_user_model")
NONFINITE = {"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN", "figures": {"grad_norm": float("nan")}}


def save_checkpoint(run_dir: Path, model: torch.nn.Module, step: int) -> str:
    """A checkpoint folder as the contract lays it out: model.safetensors + manifest.json (written last)."""
    name = f"checkpoints/step_{step:06d}"
    folder = run_dir / name
    folder.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    manifest = {"schema": 1, "step": step, "healthy": True,
                "files": {"model.safetensors": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return name


def user_bundle(run_dir: Path, *, model_kwargs=None, batch=None, finding=NONFINITE, spec=USER_SPEC, lr=1e-3,
                precision="no", step=7, checkpoint=True, ids=("clip-a", "clip-b", "clip-c"), extra=None) -> Path:
    torch.manual_seed(0)
    spec = dict(spec) if spec is not None else None
    if spec is not None and model_kwargs is not None:
        spec["kwargs"] = dict(spec["kwargs"], **model_kwargs)
    model = make_model(**(spec or {}).get("kwargs", USER_SPEC["kwargs"]))
    ckpt = save_checkpoint(run_dir, model, step - 2) if checkpoint else None
    return write_incident(run_dir, step=step, micro_step=0, rank=0, world_size=1,
                          batch=batch if batch is not None else make_batch(), sample_ids=list(ids), finding=finding,
                          lr=lr, precision=precision, seed=0, checkpoint=ckpt, model_spec=spec, extra=extra)


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    return subprocess.run([sys.executable, str(REPO / "scripts" / "replay.py"), *args], capture_output=True,
                          text=True, env=env, timeout=120)


# -- (a) bad data ---------------------------------------------------------------------------------------


def test_video_dit_nan_sample_reproduces_and_leave_one_out_names_it(tmp_path):
    from vidstab.reference.model import VideoDiT
    from vidstab.reference.objective import DiffusionObjective, step_generator

    torch.manual_seed(0)
    model = VideoDiT(in_channels=4, hidden_size=24, num_layers=1, num_heads=2)
    with torch.no_grad():  # a "trained" model: leave AdaLN-Zero's all-zero start
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(std=0.05)
    ckpt = save_checkpoint(tmp_path, model, 10)
    latents = torch.randn(3, 4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    latents[1, :, 0] = float("nan")
    batch = {"latents": latents, **DiffusionObjective().sample(latents, step_generator(0, 12, 0, 0))}
    spec = {"class": "vidstab.reference.model:VideoDiT", "config": dict(model.config),
            "loss_fn": "vidstab.reference.objective:replay_loss", "loss_fn_kwargs": {"prediction_type": "epsilon"}}
    ids = ["shapes-00016", "shapes-00017", "shapes-00018"]
    bundle = write_incident(tmp_path, step=12, micro_step=0, rank=0, world_size=1, batch=batch, sample_ids=ids,
                            finding=NONFINITE, lr=1e-4, precision="no", seed=0, checkpoint=ckpt, model_spec=spec)

    report = replay(bundle)
    assert isinstance(report, ReplayReport)
    assert report.reproduced is True and report.deterministic is True
    assert report.checkpoint_step == 10 and any("2 step(s) before" in n for n in report.notes)
    assert report.data["implicated"] and report.data["culprits"] == ["shapes-00017"]
    assert report.data["without_culprits_finite"] is True
    assert "shapes-00017" in report.data["bad_inputs"]
    assert report.localization["forward"]["module"] == "patch_embed"
    assert report.localization["forward"]["inputs_nonfinite"] is True
    assert not report.structure["implicated"] and not report.lr["implicated"] and not report.precision["implicated"]
    assert report.lr["batch"] == "the batch without the culprit samples"
    v = report.verdict
    assert v.startswith("Reproduces") and "Data:" in v and "shapes-00017" in v and "Fix the data" in v
    assert "precision, LR and structure are not implicated" in v
    saved = json.loads((bundle / "replay_report.json").read_text(),
                       parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert saved["reproduced"] is True and saved["data"]["culprits"] == ["shapes-00017"]
    assert saved["verdict"] == v


def test_two_bad_samples_are_found_alone_when_leave_one_out_cannot(tmp_path):
    batch = make_batch(batch_size=4)
    batch["latents"][0, 0, 0, 0, 0] = float("inf")
    batch["noise"][3, 1] = float("nan")
    bundle = user_bundle(tmp_path, batch=batch, ids=("a", "b", "c", "d"))
    report = replay(bundle, trust=TRUST)
    assert report.reproduced is True
    assert report.data["culprits"] == ["a", "d"] and report.data["without_culprits_finite"] is True


def test_script_replays_a_user_model_and_writes_json_where_asked(tmp_path):
    batch = make_batch()
    batch["latents"][2] *= 1e3  # finite but out of range for normalised latents
    bundle = user_bundle(tmp_path, batch=batch)
    out = tmp_path / "report.json"
    proc = run_script(str(bundle), *TRUST_ARGS, "--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Verdict:" in proc.stdout and "clip-c" in proc.stdout
    saved = json.loads(out.read_text())
    assert "absmax" in saved["data"]["bad_inputs"]["clip-c"][0]
    assert saved["model"] == "replay_user_model:make_model"


# -- (b) structure --------------------------------------------------------------------------------------


def test_module_making_inf_from_finite_inputs_is_localised_and_blamed(tmp_path):
    bundle = user_bundle(tmp_path, model_kwargs={"blowup": 1e39})
    report = replay(bundle, trust=TRUST)
    assert report.reproduced is True
    assert report.localization["forward"]["module"] == "blowup"
    assert report.localization["forward"]["inputs_nonfinite"] is False
    assert not report.data["implicated"] and report.data["culprits"] == []
    assert report.structure["implicated"] and report.structure["module"] == "blowup"
    assert "Look at module 'blowup'" in report.verdict
    assert "data, precision and LR are not implicated" in report.verdict


def test_overflow_only_in_fp16_points_at_precision(tmp_path):
    # 1e5 fits fp32 but not fp16 (max 65504): the step fails only under the run's fp16 autocast.
    bundle = user_bundle(tmp_path, model_kwargs={"blowup": 1e5}, precision="fp16")
    report = replay(bundle, trust=TRUST)
    if "not available" in report.precision["summary"]:
        pytest.skip(report.precision["summary"])
    assert report.runs[0].finite and report.reproduced is True
    assert report.precision["implicated"] is True
    assert not report.structure["implicated"]  # explained by precision
    assert report.verdict.startswith("Reproduces") and "Precision:" in report.verdict


# -- spikes, LR, determinism --------------------------------------------------------------------------


def _true_grad_norm(model_kwargs=None) -> float:
    torch.manual_seed(0)
    model = make_model(**dict(USER_SPEC["kwargs"], **(model_kwargs or {})))
    video_mse(model, make_batch()).mean().backward()
    return float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())))


def test_spike_reproduces_within_tolerance_and_not_when_far_off(tmp_path):
    g = _true_grad_norm()
    spike = {"detector": "grad_spike", "verdict": "SKIP", "message": "norm 30x EMA", "figures": {"grad_norm": g * 1.05}}
    report = replay(user_bundle(tmp_path / "a", finding=spike), trust=TRUST)
    assert report.kind == "spike" and report.reproduced is True
    spike["figures"] = {"grad_norm": g * 3}
    report = replay(user_bundle(tmp_path / "b", finding=spike), trust=TRUST)
    assert report.reproduced is False and report.verdict.startswith("Does not reproduce")


def test_lr_test_flags_an_update_that_blows_up_only_at_full_lr(tmp_path):
    spike = {"detector": "loss_spike", "verdict": "WARN", "message": "loss jumped", "figures": {"loss": 1.0}}
    bundle = user_bundle(tmp_path, finding=spike, lr=3.0, extra={"optimizer": "SGD"})
    report = replay(bundle, trust=TRUST)
    assert report.lr["optimizer"] == "sgd"
    assert report.lr["jump_at_lr"] is True and report.lr["jump_at_lr_over_10"] is False
    assert report.lr["implicated"] is True and "LR:" in report.verdict


def test_fresh_init_is_said_to_be_less_meaningful(tmp_path):
    bundle = user_bundle(tmp_path, checkpoint=False, model_kwargs={"blowup": 1e39})
    report = replay(bundle, trust=TRUST)
    assert report.checkpoint is None
    assert any("fresh initialisation" in n for n in report.notes)
    assert "fresh initialisation" in report.verdict


# -- (c) cannot replay: exit code 2 with the reason -----------------------------------------------------


def test_bundle_without_model_spec_exits_2_naming_it(tmp_path):
    bundle = user_bundle(tmp_path, spec=None)
    proc = run_script(str(bundle))
    assert proc.returncode == 2
    assert "no model spec" in proc.stderr and str(bundle) in proc.stderr


def test_wrong_import_path_exits_2_naming_the_module(tmp_path, capsys):
    spec = dict(USER_SPEC, factory="nonexistent_pkg_xyz.models:make_model")
    bundle = user_bundle(tmp_path / "a", spec=spec)
    assert main([str(bundle), "--trust", "nonexistent_pkg_xyz"]) == 2
    err = capsys.readouterr().err
    assert "nonexistent_pkg_xyz.models" in err and "model.factory" in err and "cannot import" in err

    bad_loss = user_bundle(tmp_path / "b", spec=dict(USER_SPEC, loss_fn="replay_user_model:no_such_loss"))
    assert main([str(bad_loss), *TRUST_ARGS]) == 2
    assert "no attribute 'no_such_loss'" in capsys.readouterr().err


def test_class_that_is_not_a_config_mixin_and_missing_checkpoint_exit_2(tmp_path, capsys):
    spec = {"class": "torch.nn:Linear", "config": {"in_features": 2, "out_features": 2},
            "loss_fn": "replay_user_model:video_mse"}
    assert main([str(user_bundle(tmp_path / "a", spec=spec, checkpoint=False)), *TRUST_ARGS, "--trust", "torch.nn:Linear"]) == 2
    assert "not a diffusers ConfigMixin" in capsys.readouterr().err

    bundle = user_bundle(tmp_path / "b")
    ckpt = tmp_path / "b" / "checkpoints" / "step_000005"
    (ckpt / "model.safetensors").unlink()
    assert main([str(bundle), *TRUST_ARGS]) == 2
    assert "checkpoint missing" in capsys.readouterr().err
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    assert main([str(bundle), *TRUST_ARGS]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert main([str(bundle), "--fresh-init", *TRUST_ARGS]) == 0  # a bundle away from its weights still replays
    assert "--fresh-init was asked for" in capsys.readouterr().out


@pytest.mark.parametrize("algo", ["crc32", "sha256"])
def test_checkpoint_bit_flip_is_caught_with_either_manifest_checksum(tmp_path, capsys, algo):
    bundle = user_bundle(tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_000005"
    data = (ckpt / "model.safetensors").read_bytes()
    if algo == "crc32":  # as vidstab's CheckpointManager writes it by default (the helper writes sha256)
        man = json.loads((ckpt / "manifest.json").read_text())
        man["files"]["model.safetensors"] = {"bytes": len(data), "crc32": f"0x{zlib.crc32(data):08x}"}
        (ckpt / "manifest.json").write_text(json.dumps(man))
    flipped = bytearray(data)
    flipped[len(flipped) - 3] ^= 0x01  # one bit of the last weight's bytes: still a loadable safetensors file
    (ckpt / "model.safetensors").write_bytes(bytes(flipped))
    assert main([str(bundle), *TRUST_ARGS]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is corrupt" in err and f"{algo} mismatch" in err


def test_run_folder_replays_its_first_incident(tmp_path, capsys):
    user_bundle(tmp_path, model_kwargs={"blowup": 1e39})
    assert main([str(tmp_path), *TRUST_ARGS]) == 0
    out = capsys.readouterr().out
    assert "replaying the first" in out and "Verdict: Reproduces" in out


def test_exception_incident_reproduces_and_names_the_sample(tmp_path):
    batch = make_batch()
    batch["latents"][2] *= 1e3
    finding = {"detector": "exception", "verdict": "SKIP", "message": "exception on rank 0", "figures": {}}
    spec = dict(USER_SPEC, loss_fn_kwargs={"max_abs": 100.0})
    report = replay(user_bundle(tmp_path, batch=batch, finding=finding, spec=spec,
                                extra={"error": "ValueError: latents exceed 100.0"}), trust=TRUST)
    assert report.kind == "exception" and report.reproduced is True
    assert "latents exceed 100.0" in report.runs[0].error
    assert report.data["culprits"] == ["clip-c"] and "Fix the data" in report.verdict


def test_whole_micro_batch_bad_is_said_so(tmp_path):
    batch = make_batch()
    batch["latents"][:] = float("nan")  # what --inject_fault nan_batch does
    report = replay(user_bundle(tmp_path, batch=batch), trust=TRUST)
    assert report.reproduced is True and report.data["whole_batch_bad"] is True
    assert report.data["culprits"] == ["clip-a", "clip-b", "clip-c"]
    assert "whole micro-batch is bad" in report.verdict and report.lr["summary"].startswith("skipped")
