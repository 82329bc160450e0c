"""The guard in a real single-process Accelerate loop (CPU, fp32): skip semantics, host syncs, state."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import vidstab
from vidstab import GuardConfig, Verdict, read_events


class TinyDenoiser(torch.nn.Module):
    """Predicts noise from noisy latents [B, C, T, H, W] and the timestep (diffusers-style epsilon objective)."""

    def __init__(self, c: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(c, hidden, 1)
        self.t = torch.nn.Linear(1, hidden)
        self.out = torch.nn.Conv3d(hidden, c, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.t(t.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(torch.nn.functional.silu(h))


def make(tmp_path, accum: int = 1, config: GuardConfig | None = None, lr: float = 1e-2, seed: int = 0):
    torch.manual_seed(seed)
    acc = Accelerator(gradient_accumulation_steps=accum, cpu=True)
    model = TinyDenoiser()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, config=config, run_dir=tmp_path)
    return acc, model, opt, sched, guard


def micro_batch(i: int, nan: bool = False, b: int = 2):
    g = torch.Generator().manual_seed(1000 + i)
    latents = torch.randn(b, 4, 2, 4, 4, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    t = torch.randint(0, 1000, (b,), generator=g)
    if nan:
        latents[0, 0, 0, 0, 0] = float("nan")
    return {"latents": latents, "noise": noise, "timesteps": t}, [f"clip-{i:03d}-{j}" for j in range(b)]


def train(acc, model, guard, micro_steps: int, nan_at: set[int] = frozenset(), on_result=None, error_at=frozenset(),
          loss_mult: float = 1.0):
    results = []
    for i in range(micro_steps):
        batch, ids = micro_batch(i, nan=i in nan_at)
        with acc.accumulate(model):
            noisy = batch["latents"] + batch["noise"]
            per_sample = ((model(noisy, batch["timesteps"]) - batch["noise"]) ** 2).flatten(1).mean(1)
            loss = per_sample.mean() * loss_mult
            err = RuntimeError("injected") if i in error_at else None
            if err is not None:
                loss = loss * 0.0
            guard.backward(loss, batch=batch, sample_ids=ids, per_sample_loss=per_sample, error=err)
            r = guard.step(max_grad_norm=1.0)
            if on_result is not None:
                on_result(i, r)
            if not r.micro:
                results.append(r)
    return results


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def test_nan_microbatch_skips_the_step(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=2)
    seen = {}

    def on_result(i, r):
        if i == 5:  # last micro-step of optimizer step 2, whose first micro-batch (4) holds a NaN
            seen["skipped_flag"] = acc.optimizer_step_was_skipped
            seen["after"] = params_of(model)
            seen["epoch_after"] = sched.scheduler.last_epoch
        if i == 3:
            seen["before"] = params_of(model)
            seen["epoch_before"] = sched.scheduler.last_epoch

    results = train(acc, model, guard, micro_steps=10, nan_at={4}, on_result=on_result)
    r = results[2]
    assert r.skipped and not r.applied and r.verdict == Verdict.SKIP
    assert [f.detector for f in r.findings][0] == "nonfinite" and r.bad_ranks == [0]
    assert seen["skipped_flag"] is True
    assert seen["epoch_after"] == seen["epoch_before"]  # the scheduler was held
    for a, b in zip(seen["before"], seen["after"]):
        assert torch.equal(a, b) and torch.isfinite(b).all()
    assert all(x.applied for k, x in enumerate(results) if k != 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert acc.optimizer_step_was_skipped is False  # reset by the next applied step
    # Evidence: a skip event naming the rank and an incident bundle with the NaN micro-batch's sample ids.
    skips = read_events(tmp_path, "skip")
    assert [(e["step"], e["detector"], e["bad_ranks"]) for e in skips] == [(2, "nonfinite", [0])]
    inc = read_events(tmp_path, "incident")
    assert len(inc) == 1 and inc[0]["sample_ids"] == ["clip-004-0", "clip-004-1"] and inc[0]["micro_step"] == 0
    assert r.incident is not None and (r.incident / "incident.json").exists()
    meta = json.loads((r.incident / "incident.json").read_text())
    assert meta["step"] == 2 and meta["detector"] == "nonfinite"
    assert guard.skipped_total == 1 and guard.step_count == 5


class HostReads:
    """Counts device->host reads (Tensor.item/tolist/__bool__/cpu/numpy/__float__) while active. Observes only."""

    NAMES = ("item", "tolist", "__bool__", "cpu", "numpy", "__float__", "__int__")

    def __init__(self):
        self.count = 0
        self.by_name: dict[str, int] = {}

    @contextlib.contextmanager
    def counting(self):
        originals = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def wrap(name, fn):
            def inner(*a, **k):
                self.count += 1
                self.by_name[name] = self.by_name.get(name, 0) + 1
                return fn(*a, **k)
            return inner

        for n, fn in originals.items():
            setattr(torch.Tensor, n, wrap(n, fn))
        try:
            yield self
        finally:
            for n, fn in originals.items():
                setattr(torch.Tensor, n, fn)


def test_one_host_read_per_optimizer_step_none_per_micro_batch(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=4, config=GuardConfig(param_norm_every=2))
    per_call = []
    reads = HostReads()

    def on_result(i, r):
        per_call.append((i, r.micro, reads.count))

    with reads.counting():
        results = train(acc, model, guard, micro_steps=24, on_result=on_result)
    assert len(results) == 6 and all(r.applied for r in results)
    assert reads.count == 6, reads.by_name  # exactly one read per optimizer step ...
    counts = [c for _, _, c in per_call]
    deltas = [b - a for a, b in zip([0] + counts, counts)]
    assert deltas == [0, 0, 0, 1] * 6  # ... and none on the micro-steps


def test_param_norm_and_timestep_buckets_are_reported(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=1, config=GuardConfig(param_norm_every=2, timestep_buckets=4))
    train(acc, model, guard, micro_steps=5)
    metrics = {e["step"]: e for e in read_events(tmp_path, "metrics")}
    ref = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    assert metrics[1]["param_norm"] > 0 and 0 < metrics[1]["update_ratio"] < 1  # measured at 0, read at 1
    assert metrics[2]["param_norm"] is None
    assert len(metrics[3]["loss_by_t"]) == 4 and any(v is not None for v in metrics[3]["loss_by_t"])
    assert metrics[3]["input_absmax"] > 0 and metrics[3]["input_nonfinite"] == 0
    # The measurement taken after step 4 (read at step 5) equals the norm computed independently.
    train(acc, model, guard, micro_steps=1)
    last = read_events(tmp_path, "metrics")[-1]
    assert last["step"] == 5 and abs(last["param_norm"] - ref) < 1e-5 * ref


def test_healthy_steps_match_a_plain_loop_bitwise(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path / "a", accum=2)
    train(acc, model, guard, micro_steps=8)
    guarded = params_of(model)

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    acc2 = Accelerator(gradient_accumulation_steps=2, cpu=True)
    m2 = TinyDenoiser()
    o2 = torch.optim.SGD(m2.parameters(), lr=1e-2, momentum=0.9)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 1.0 / (1.0 + s))
    m2, o2, s2 = acc2.prepare(m2, o2, s2)
    for i in range(8):
        batch, _ = micro_batch(i)
        with acc2.accumulate(m2):
            loss = ((m2(batch["latents"] + batch["noise"], batch["timesteps"]) - batch["noise"]) ** 2).flatten(1).mean(1).mean()
            acc2.backward(loss)
            if acc2.sync_gradients:
                acc2.clip_grad_norm_(m2.parameters(), 1.0)
            o2.step()
            s2.step()
            o2.zero_grad(set_to_none=True)
    for a, b in zip(guarded, m2.parameters()):
        assert torch.equal(a, b.detach())


def test_exception_flag_requests_rollback_on_every_rank(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=1)
    results = train(acc, model, guard, micro_steps=3, error_at={1})
    r = results[1]
    assert r.verdict == Verdict.ROLLBACK and r.rollback.startswith("exception:") and not r.applied
    assert r.bad_ranks == [0]
    assert [e["detector"] for e in read_events(tmp_path, "rollback_request")] == ["exception"]


def test_request_stop_is_seen_at_the_next_step(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=2)
    flags = []

    def on_result(i, r):
        if i == 2:
            guard.request_stop()  # e.g. from a SIGTERM handler, mid-window
        if not r.micro:
            flags.append(r.stop)

    train(acc, model, guard, micro_steps=8, on_result=on_result)
    assert flags == [False, True, False, False]
    assert [e["step"] for e in read_events(tmp_path, "stop")] == [1]


def test_scale_lr_survives_scheduler_steps_and_reapply_is_idempotent(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=1, lr=0.1)
    train(acc, model, guard, micro_steps=2)
    guard.scale_lr(0.5)
    train(acc, model, guard, micro_steps=2)
    # LambdaLR: lr = base * 1/(1+epoch); the multiplier must survive the recomputation.
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 / (1 + sched.scheduler.last_epoch))
    guard.reapply_lr_multiplier()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 / (1 + sched.scheduler.last_epoch))
    # A freshly rebuilt scheduler (un-multiplied) gets the multiplier back.
    state = guard.state_dict()
    sched.scheduler.base_lrs = [0.1]
    opt.param_groups[0]["lr"] = 0.1 / (1 + sched.scheduler.last_epoch)
    guard.load_state_dict(json.loads(json.dumps(state)))
    guard.reapply_lr_multiplier()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 / (1 + sched.scheduler.last_epoch))
    assert guard.lr_multiplier == 0.5


def test_guard_state_travels_with_save_state_as_json(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path / "run", accum=1)
    train(acc, model, guard, micro_steps=6, nan_at={2})
    guard.scale_lr(0.5)
    saved = guard.state_dict()
    ckpt = tmp_path / "ckpt"
    acc.save_state(str(ckpt))
    # Beside the state: the steps in-place rollbacks undid (none here), so a relaunch numbers on as the run did.
    assert json.loads((ckpt / "vidstab_guard.json").read_text()) == dict(json.loads(json.dumps(saved)), steps_lost=0)
    assert not [p for p in ckpt.iterdir() if "vidstab" in p.name and p.suffix != ".json"]

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2, model2, opt2, sched2, guard2 = make(tmp_path / "run2", accum=1)
    assert guard2.step_count == 0
    acc2.load_state(str(ckpt))
    assert guard2.state_dict() == json.loads(json.dumps(saved))
    assert guard2.step_count == 6 and guard2.skipped_total == 1 and guard2.lr_multiplier == 0.5
    guard2.reapply_lr_multiplier()  # the scheduler state already carried the multiplier: no change
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert [e["kind"] for e in read_events(tmp_path / "run2", "resume")] == ["resume"]


BAD_GUARD_STATE = [  # (field, value written, what the message says)
    ("steps_lost", "3", "'steps_lost' is '3'; expected an integer from 0 to"),
    ("steps_lost", None, "'steps_lost' is 'None'; expected an integer from 0 to"),
    ("steps_lost", -1, "'steps_lost' is '-1'; expected an integer from 0 to"),
    ("steps_lost", 10**30, "'steps_lost' is '1000000000000000000000000000000'; expected an integer from 0 to"),
    ("steps_lost", 7, "'steps_lost' is '7'; expected at most 'step_count' (6)"),
    ("step_count", [6], "'step_count' is '[6]'; expected an integer"),
    ("lr_multiplier", "nan", "'lr_multiplier' is 'nan'; expected a finite number > 0"),
    ("clip_flags", [0, 2], "'clip_flags' is '[0, 2]'; expected a list of 0 and 1"),
    (None, "[1, 2]", "unreadable guard state (a JSON list, not an object)"),
    (None, "{not json", "unreadable guard state (not JSON: "),
]


def test_a_malformed_guard_state_file_is_refused_naming_the_file_and_the_field(tmp_path):
    from vidstab.checkpoint import CheckpointError

    acc, model, opt, sched, guard = make(tmp_path / "run", accum=1)
    train(acc, model, guard, micro_steps=6)
    ckpt = tmp_path / "checkpoint-6"
    acc.save_state(str(ckpt))
    path = ckpt / "vidstab_guard.json"
    good = json.loads(path.read_text())
    weights, state = params_of(model), guard.state_dict()
    detectors = dict(good["detectors"], lr_jump={"ema": {"mean": [1.0]}, "quiet_until": 0})  # after others loaded
    cases = [*BAD_GUARD_STATE, ("detectors", detectors, "(detector 'lr_jump': TypeError: ")]
    for field, value, message in cases:  # one saved folder, each bad value written into it in turn
        text = json.dumps(dict(good, **{field: value})) if field else value
        path.write_text(text)
        with pytest.raises(CheckpointError) as refused:
            acc.load_state(str(ckpt))
        # Attached: the script ends with exit code 2 and no traceback (SystemExit), said in a stop event.
        assert isinstance(refused.value, SystemExit) and refused.value.code == 2
        assert read_events(tmp_path / "run", "stop")[-1]["reason"] == "resume_refused"
        assert str(refused.value).startswith(f"{path}: unreadable guard state (") and message in str(refused.value), (
            field, value, str(refused.value))
        # Nothing applied, nothing on disk touched.
        assert guard.state_dict() == state and guard.numbering.lost == 0
        assert all(torch.equal(a, b) for a, b in zip(params_of(model), weights))
        assert path.read_text() == text


def test_a_checkpoint_whose_guard_state_is_malformed_is_skipped_naming_it(tmp_path):
    """The checkpoint manager checks the guard's state (vidstab.json) while it decodes, before anything is
    applied: a checksummed but malformed one makes that checkpoint invalid, and the previous one is loaded."""
    import zlib

    acc, model, opt, sched, guard = make(tmp_path, accum=1)
    ckpt = vidstab.CheckpointManager(acc, str(tmp_path), vidstab.CheckpointConfig(async_save=False))
    for name, obj in (("model", model), ("optimizer", opt), ("vidstab", guard)):
        ckpt.register(name, obj)
    for step in (2, 4):
        train(acc, model, guard, micro_steps=2)
        ckpt.save(step)
    folder = Path(ckpt.root) / "step_000004"
    data = json.dumps(dict(json.loads((folder / "vidstab.json").read_text()), lr_multiplier=-1.0)).encode()
    (folder / "vidstab.json").write_bytes(data)
    man = json.loads((folder / "manifest.json").read_text())
    man["files"]["vidstab.json"] = {"bytes": len(data), "crc32": f"0x{zlib.crc32(data):08x}"}
    (folder / "manifest.json").write_text(json.dumps(man))
    state = ckpt.load("latest")
    assert state["_checkpoint"]["path"].endswith("step_000002") and guard.step_count == 2
    (skipped,) = state["_checkpoint"]["skipped"]
    assert skipped[1] == ("step_000004/vidstab.json: unreadable guard state ('lr_multiplier' is '-1.0'; expected a "
                          "finite number > 0)")
    assert (folder / "vidstab.json").read_bytes() == data  # kept as it is


def test_disabled_guard_is_a_plain_step(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=1, config=GuardConfig(enabled=False))
    results = train(acc, model, guard, micro_steps=3, nan_at={1})
    assert all(r.applied for r in results)  # no judgement at all
    assert not torch.isfinite(next(model.parameters())).all()  # ... which is exactly what vidstab prevents


def test_grad_spike_captures_the_window_largest_input_first(tmp_path):
    cfg = GuardConfig.from_dict({"grad_spike": {"warmup_steps": 3}, "max_incidents": 3})
    acc, model, opt, sched, guard = make(tmp_path, accum=2, config=cfg)
    results = []
    for i in range(16):
        batch, ids = micro_batch(i)
        if i in (9, 13):  # a huge (finite) latent batch: a gradient spike, no NaN anywhere
            batch["latents"] = batch["latents"] * 1e4
        with acc.accumulate(model):
            loss = ((model(batch["latents"] + batch["noise"], batch["timesteps"]) - batch["noise"]) ** 2).mean()
            guard.backward(loss, batch=batch, sample_ids=ids)
            r = guard.step(max_grad_norm=1.0)
        if not r.micro:
            results.append(r)
    spike = results[4]
    assert spike.skipped and [f.detector for f in spike.findings] == ["grad_spike"] and spike.bad_ranks == [0]
    assert len(spike.incidents) == 2  # the whole window of the suspect rank ...
    first = json.loads((spike.incidents[0] / "incident.json").read_text())
    assert first["micro_step"] == 1 and first["sample_ids"] == ["clip-009-0", "clip-009-1"]  # ... largest input first
    assert results[6].skipped and len(results[6].incidents) == 1  # the per-rank budget (max_incidents=3) holds
    assert guard.reporter.incidents_written == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_first_nonfinite_incident_is_localized(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=1)
    unwrapped = acc.unwrap_model(model)

    class NaNAfterInp(torch.nn.Module):  # a module that produces NaN for inputs beyond a threshold
        def forward(self, x):
            return torch.where(x.abs() > 50, torch.full_like(x, float("nan")), x)

    unwrapped.inp = torch.nn.Sequential(unwrapped.inp, NaNAfterInp())
    guard.set_replay_fn(lambda b: ((unwrapped(b["latents"] + b["noise"], b["timesteps"]) - b["noise"]) ** 2).mean())
    results = []
    for i in range(4):
        batch, ids = micro_batch(i)
        if i in (1, 2):
            batch["latents"] = batch["latents"] * 1e3
        with acc.accumulate(model):
            loss = ((model(batch["latents"] + batch["noise"], batch["timesteps"]) - batch["noise"]) ** 2).mean()
            guard.backward(loss, batch=batch, sample_ids=ids)
            results.append(guard.step(max_grad_norm=1.0))
    assert results[1].skipped and results[2].skipped and results[3].applied
    loc1 = json.loads((results[1].incident / "incident.json").read_text())["localization"]
    loc2 = json.loads((results[2].incident / "incident.json").read_text())["localization"]
    assert loc1 is not None and "inp" in json.dumps(loc1["forward"])  # names the module that made the NaN
    assert loc2 is None  # only the first non-finite incident is replayed by default
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())  # the replay left no gradients behind


def test_metrics_reach_the_accelerator_trackers(tmp_path):
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, log_with="tensorboard",
                      project_config=ProjectConfiguration(project_dir=str(tmp_path), logging_dir=str(tmp_path / "logs")))
    acc.init_trackers("vidstab-test")
    model = TinyDenoiser()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, None, config=GuardConfig(log_every=2), run_dir=tmp_path)
    train(acc, model, guard, micro_steps=4)
    acc.end_training()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert files
    ea = EventAccumulator(str(files[0].parent))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert {"vidstab/loss", "vidstab/grad_norm", "vidstab/lr", "vidstab/skipped_total"} <= set(tags)
    assert [e.step for e in ea.Scalars("vidstab/grad_norm")] == [0, 2]  # every log_every steps


def test_fp16_overflow_is_left_to_the_grad_scaler(tmp_path):
    """CPU emulation of the fp16 path: Accelerate only builds a GradScaler on GPUs, so the test hands the
    Accelerator a real CPU GradScaler with a huge initial scale (fp32 compute): the first steps overflow."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 125, backoff_factor=0.01, growth_interval=1000)
    model = TinyDenoiser()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.native_amp = True  # after prepare: fp32 forward, but accelerator.backward/clip go through the scaler
    guard = vidstab.attach(acc, model, opt, None, run_dir=tmp_path)
    results = train(acc, model, guard, micro_steps=12, nan_at={10}, loss_mult=100.0)  # large grads x 2^125: inf
    scales = [e["loss_scale"] for e in read_events(tmp_path, "metrics")]
    assert results[0].overflow and not results[0].applied and not results[0].skipped and results[0].verdict == Verdict.OK
    assert scales[1] < scales[0]  # the scaler lowered the scale
    n_over = sum(r.overflow for r in results)
    assert n_over >= 1 and guard.overflow_total == n_over and guard.skipped_total == 1  # overflows are not skips
    assert results[n_over].applied  # then training proceeds
    assert results[10].skipped and results[10].bad_ranks == [0]  # a NaN loss is still vidstab's business ...
    assert results[11].applied  # ... and the scaler is left in a usable state after the skip
    assert [(e["step"], e["detector"]) for e in read_events(tmp_path, "skip")] == [(10, "nonfinite")]
    assert [e["step"] for e in read_events(tmp_path, "incident")] == [10]  # overflows capture nothing
    assert len(read_events(tmp_path, "overflow")) == n_over
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_weights_request_rollback_and_a_restore_clears_it(tmp_path):
    acc, model, opt, sched, guard = make(tmp_path, accum=1, config=GuardConfig(param_norm_every=1))
    train(acc, model, guard, micro_steps=2)
    good_weights = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    good_state = json.loads(json.dumps(guard.state_dict()))
    with torch.no_grad():
        next(model.parameters())[0].fill_(float("nan"))  # e.g. a bad update slipped through elsewhere
    r2, r3 = train(acc, model, guard, micro_steps=2)
    assert r2.skipped and r2.rollback is None  # non-finite grads: skipped (params measured after this step)
    assert r3.rollback is not None and "nonfinite_params" in r3.rollback and not guard.healthy
    # What recovery does: restore the weights and the guard state of the last good checkpoint.
    acc.unwrap_model(model).load_state_dict(good_weights)
    guard.load_state_dict(good_state)
    assert guard.healthy and guard.step_count == 2
    assert guard.skipped_total == 2  # counters of what happened never go backward with a rollback
    after = train(acc, model, guard, micro_steps=3)
    assert all(r.applied and r.verdict == Verdict.OK for r in after)  # nothing stale judged after the restore


def test_a_warning_makes_checkpoints_unhealthy_for_the_health_window(tmp_path):
    """A slowly diverging run warns before it skips: a checkpoint taken then must not be a rollback target."""
    config = GuardConfig.from_dict({"health_window": 5})
    acc, model, opt, sched, guard = make(tmp_path, config=config)
    health = []

    def jump_lr_at_6(i, r):
        health.append(guard.healthy)
        if i == 5:  # x9 the scheduled 1/7 of the peak = 1.29x the peak for the next step: lr_bound warns (a
            for group in opt.param_groups:  # forecast, nothing skipped); x10 the scheduled LR would be refused
                group["lr"] *= 9

    results = train(acc, model, guard, 14, on_result=jump_lr_at_6)
    warned = [r.step for r in results if any(f.detector == "lr_bound" for f in r.findings)]
    assert warned == [6] and not any(r.skipped for r in results)
    assert health[:6] == [True] * 6          # quiet so far
    assert health[6:11] == [False] * 5       # the warning step and the 4 after it
    assert health[11:] == [True] * 3         # health_window steps later the run counts as healthy again
    # the gate survives a save/load of the guard state
    state = json.loads(json.dumps(guard.state_dict()))
    assert state["last_anomaly_step"] == 6


def test_clip_rate_metric_counts_the_clip_rate_detectors_window(tmp_path):
    """One window for the clip rate: the metric and the saved flags follow ``clip_rate.window``."""
    cfg = GuardConfig.from_dict({"clip_rate": {"window": 3}})
    acc, model, opt, sched, guard = make(tmp_path, config=cfg)
    train(acc, model, guard, micro_steps=6, loss_mult=100.0)  # norms well above max_grad_norm=1: clipped
    metrics = read_events(tmp_path, "metrics")
    clipped = [m["clipped"] for m in metrics]
    assert len(clipped) == 6 and any(clipped)
    assert guard.state_dict()["clip_flags"] == [int(c) for c in clipped[-3:]]
    assert [m["clip_rate"] for m in metrics[2:]] == [pytest.approx(sum(clipped[i - 2:i + 1]) / 3) for i in range(2, 6)]


def test_micro_step_flags_have_named_fields():
    """What an incident reads about each micro-step of the window (``signals.MicroFlags``)."""
    from vidstab import signals

    w = signals.Window("cpu", 0, 1000)
    w.record(torch.tensor(1.0), {"x": torch.tensor([1.0, -3.0])})
    w.record(torch.tensor(float("nan")), {"x": torch.tensor([float("nan"), 2.0])}, error=True)
    first, second = w.micro_flags()
    assert (first.loss_nonfinite, first.input_nonfinite, first.input_absmax, first.exception) == (False, 0, 3.0, False)
    assert second.loss_nonfinite and second.input_nonfinite == 1 and math.isnan(second.input_absmax) and second.exception
