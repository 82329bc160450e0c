"""The reference trainer end to end, as a user runs it: real processes, real files, real faults."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vidstab.files.strict_json import json_float

from trainer_utils import REPO, events, losses_by_step, run_trainer, run_trainers

sys.path.insert(0, str(REPO / "recipes"))
import args as train_args  # noqa: E402  (recipes/args.py: the trainer's flags)


def _finite(x):
    """A logged number that is finite. Event logs are strict JSON (vidstab.files.strict_json): a non-finite number is
    "nan"/"inf"/"-inf" (null in logs from before that convention, and for a value not measured)."""
    f = json_float(x)
    return f is not None and math.isfinite(f)


def _weights(output_dir, step):
    return load_file(str(output_dir / "vidstab" / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def test_tiny_run_finishes_with_checkpoints_events_and_summary(tmp_path):
    out = tmp_path / "run"
    proc = run_trainer(out, "--max_train_steps", "12", "--checkpointing_steps", "5", html_report=True)
    assert "done: 12/12 steps" in proc.stdout
    assert (out / "vidstab" / "checkpoints" / "latest").read_text().strip() == "step_000012"
    for step in (5, 10, 12):
        assert (out / "vidstab" / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    metrics = events(out, kind="metrics")
    assert [m["step"] for m in metrics] == list(range(12))
    assert all(_finite(m["loss"]) and _finite(m["grad_norm"]) for m in metrics)
    assert (out / "report.html").is_file()


def test_default_size_flow_matching_run_learns_the_shapes(tmp_path):
    """README's demo: the default model and data with flow matching, 300 steps, default validation."""
    out = tmp_path / "run"
    run_trainer(out, "--num_videos", "64", "--train_batch_size", "8", "--hidden_size", "64", "--num_heads", "4",
                "--lr_warmup_steps", "20", "--checkpointing_steps", "300", "--prediction_type", "flow_matching")
    losses = [m["loss"] for m in events(out, kind="metrics")]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert len(losses) == 300 and last < 0.6 * first, f"loss did not drop: first10={first:.4f} last10={last:.4f}"
    # Sampled latents land much nearer the training clips than the noise they start from.
    final = events(out, kind="validation")[-1]
    assert final["step"] == 300 and final["nn_distance"] < 0.8 * final["noise_nn_distance"], final


def test_flow_matching_ema_accumulation_checkpointing_train_and_resume(tmp_path):
    out = tmp_path / "run"
    flags = ["--checkpointing_steps", "2", "--use_ema", "--prediction_type", "flow_matching", "--gradient_accumulation_steps", "2",
             "--gradient_checkpointing", "--attention_type", "full", "--pos_embed", "sincos"]
    run_trainer(out, "--max_train_steps", "2", *flags)
    assert (out / "vidstab" / "checkpoints" / "step_000002" / "ema.safetensors").is_file()
    proc = run_trainer(out, "--max_train_steps", "4", "--resume_from_checkpoint", "latest", *flags)
    assert "done: 4/4 steps" in proc.stdout and "written with config" not in proc.stdout + proc.stderr
    assert [m["step"] for m in events(out, kind="metrics")][-2:] == [2, 3]


def test_bad_config_value_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 1.0\n")
    # One real trainer process: the trainer itself exits on a bad key before building anything. The flag checks
    # it runs (recipes/args.py) are the same function for every flag; the other two are checked in-process.
    typo = run_trainer(tmp_path / "run1", "--config", str(bad), check=False)
    assert typo.returncode != 0 and "learning_rat" in typo.stderr
    for argv, expected in ((["--max_train_steps", "0"], "--max_train_steps must be >= 1"),
                           (["--inject_fault", "nan_bach@3"], "nan_bach")):
        err = io.StringIO()
        with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
            train_args.parse_args(argv)
        assert expected in err.getvalue(), (argv, err.getvalue())


def test_resume_continues_at_the_right_step_with_bitwise_same_losses(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    # The uninterrupted run and the first segment are independent: started together.
    run_trainers((full, "--max_train_steps", "10", "--checkpointing_steps", "4"),
                 (split, "--max_train_steps", "6", "--checkpointing_steps", "4"))
    # stopped after step 6 (final checkpoint at 6); resume from `latest` and run to 10
    proc = run_trainer(split, "--max_train_steps", "10", "--checkpointing_steps", "4", "--resume_from_checkpoint", "latest")
    assert "done: 10/10 steps" in proc.stdout
    assert [r["step"] for r in events(split, kind="resume")] == [6]
    a, b = losses_by_step(full), losses_by_step(split)
    assert all(a[s] == b[s] for s in range(6, 10)), {s: (a[s], b[s]) for s in range(6, 10)}
    assert all(torch.equal(_weights(full, 10)[k], v) for k, v in _weights(split, 10).items())


@pytest.mark.slow
def test_nan_batch_on_rank1_is_skipped_on_every_rank_and_captured(nan_batch_rank1_run):
    out = nan_batch_rank1_run  # 2 processes, nan_batch@4:1, checkpoints every 3 of 9 steps, a kill and restart at 8
    for rank in (0, 1):
        skips = [e["step"] for e in events(out, rank, "skip")]
        assert skips == [4], f"rank {rank} skipped {skips}"
    assert 1 in events(out, 0, "skip")[0]["bad_ranks"]
    bundles = list((out / "vidstab" / "incidents").glob("step000004-rank1*"))
    assert bundles, "no incident bundle on rank 1"
    meta = json.loads((bundles[0] / "incident.json").read_text())
    assert meta["rank"] == 1 and meta["step"] == 4 and len(meta["sample_ids"]) == 4
    w = _weights(out, 6)
    assert all(torch.isfinite(t).all() for t in w.values())


def test_lr_spike_rolls_back_with_halved_lr_and_finishes_finite(tmp_path):
    out = tmp_path / "run"
    proc = run_trainer(out, "--max_train_steps", "40", "--checkpointing_steps", "5", "--inject_fault", "lr_spike@12=1e4")
    rollbacks = events(out, kind="rollback")  # the recovery's action (the guard logs "rollback_request")
    assert rollbacks, f"no rollback:\n{proc.stdout[-2000:]}"
    assert rollbacks[0]["lr_multiplier"] == 0.5
    metrics = events(out, kind="metrics")
    assert _finite(metrics[-1]["loss"]) and metrics[-1]["step"] == 39
    assert all(torch.isfinite(t).all() for t in _weights(out, 40).values())


def test_growth_warning_comes_before_the_first_nonfinite_value(tmp_path):
    out = tmp_path / "run"
    # Spikes only warn here, so the run is left to diverge and we can see whether the growth detector
    # forecast it. A slowly rising LR (x1.3 per step from step 60) makes the grad norm grow exponentially.
    # lr_bound (which refuses the ramp from 3x the schedule's peak on) and trend (which rolls back on the
    # corroborated warnings) are set to warn / off for the same reason.
    warn_only = tmp_path / "warn_only.yaml"
    warn_only.write_text("grad_spike: {action: warn}\nloss_spike: {action: warn}\nrepeated_spikes: {enabled: false}\n"
                         "lr_bound: {action: warn}\ntrend: {enabled: false}\n")
    run_trainer(out, "--max_train_steps", "110", "--checkpointing_steps", "200", "--inject_fault", "lr_ramp@60=1.3",
                "--vidstab_config", str(warn_only), "--max_retries", "0", check=False)
    warns = [e["step"] for e in events(out, kind="warn") if e.get("detector") == "grad_growth"]
    metrics = events(out, kind="metrics")
    blown = [m["step"] for m in metrics if not _finite(m["loss"]) or m["loss"] > 3 * metrics[59]["loss"]]
    assert blown, "the scenario did not diverge"
    assert warns and warns[0] < blown[0], f"growth warnings {warns}, divergence at {blown[0]}"


def test_exception_inside_the_step_recovers_in_process(tmp_path):
    out = tmp_path / "run"
    proc = run_trainer(out, "--max_train_steps", "12", "--checkpointing_steps", "4", "--inject_fault", "exception@6")
    assert "done: 12/12 steps" in proc.stdout
    rollbacks = events(out, kind="rollback")
    assert len(rollbacks) == 1 and "exception" in json.dumps(rollbacks[0])
    # FAST passes --no_html_report: no dashboard written, and the summary line says why.
    assert not (out / "report.html").exists() and "report: (not written: --no_html_report)" in proc.stdout


def test_run_exports_a_loadable_model_ema_and_validation_clips(tmp_path):
    import av
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vidstab.reference.model import VideoDiT

    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "4", "--checkpointing_steps", "4", "--use_ema", "--validation_steps", "2",
                "--num_validation_videos", "2", "--validation_num_inference_steps", "3", "--report_to", "tensorboard", html_report=True)
    # TensorBoard (the trainer's default tracker; FAST turns trackers off, so it is named here) writes its files
    assert list((out / "logs").rglob("events.out.tfevents*")), "no TensorBoard event file written"
    model = VideoDiT.from_pretrained(str(out / "transformer"))
    checkpoint = _weights(out, 4)
    assert model.state_dict().keys() == checkpoint.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in checkpoint.items()), "export differs from the final weights"
    ema = VideoDiT.from_pretrained(str(out / "transformer_ema"))
    assert any(not torch.equal(ema.state_dict()[k], v) for k, v in checkpoint.items()), "transformer_ema holds the live weights"

    validations = events(out, kind="validation")
    assert [v["step"] for v in validations] == [2, 4] and all(v["ema"] for v in validations)
    for v in validations:
        assert (out / v["strip"]).is_file() and len(v["videos"]) == 2
        with av.open(str(out / v["videos"][0])) as container:
            frames = list(container.decode(video=0))
        assert len(frames) == 9 and (frames[0].height, frames[0].width) == (32, 32)
        assert v["noise_nn_distance"] > 0 and v["data_nn_distance"] > 0 and v["nn_distance"] > 0
    assert "validation/step_000004/strip.png" in (out / "report.html").read_text()
    tb = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents*")).parent), size_guidance={"images": 0})
    tb.Reload()
    assert [e.step for e in tb.Images("validation")] == [2, 4]

    # recipes/sample.py samples the exported folder (the EMA weights here) the same way
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sample.py"), "--model_dir", str(out), "--use_ema", "--num_videos", "2",
                           "--num_inference_steps", "3", "--output_dir", str(tmp_path / "samples")],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"].endswith("transformer_ema") and len(result["videos"]) == 2
    assert (tmp_path / "samples" / "strip.png").is_file() and result["noise_nn_distance"] > 0
