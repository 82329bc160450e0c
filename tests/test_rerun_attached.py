"""The in-job rerun and the quarantine in the attached form (the README's lines plus
``loader = guard.track_samples(loader)``), with a diffusers ``UNet2DModel`` and no replay function: the rerun runs
the recorded inputs forward and the recorded output gradient backward. A NaN sample of the data set is ``data``,
named by its index and quarantined, and not seen in epoch 2 nor after a resume; one activation corrupted once
(``flaky_activation``) is ``transient``; under DDP a layer broken on one rank only is ``suspect_hardware``. On 1
process (in this process), and on 2: one launch for DDP, one for its resume and the drill under hand-applied FSDP2.
The explicit form with a diffusers model needs no replay function either; elsewhere ``not_rerun`` says what to
pass."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_guard_distributed import launch

from vidstab.engines import ZeroEngine
from vidstab.recovery.quarantine import QuarantineList

BAD = 5  # tests/scripts/rerun_attached.py: the data set's NaN sample


def _drill():
    """tests/scripts/rerun_attached.py as a module (the 1-process drills run in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rerun_attached", Path(__file__).parent / "scripts" / "rerun_attached.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _events(out: Path, rank: int, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "vidstab" / f"events-rank{rank}.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == kind]


def _seen(out: Path, phase: str, world: int) -> tuple[dict[int, list[int]], list[bool]]:
    by_epoch: dict[int, list[int]] = {}
    matches: list[bool] = []
    for rank in range(world):
        got = json.loads((out / f"seen-rank{rank}-{phase}.json").read_text())
        for epoch, ids in got["seen"].items():
            by_epoch.setdefault(int(epoch), []).extend(ids)
        matches += got["ids_match"]
    return by_epoch, matches


def _check_drill(out: Path, phase: str, world: int, flaky_step: int, peer: bool, sick_step: int | None = None) -> None:
    """The NaN sample: data, named by its index, quarantined, gone from epoch 2; the flaky step: transient; the
    sick step (DDP): suspect hardware on the last rank, its host named."""
    seen, matches = _seen(out, phase, world)
    assert all(matches) and len(matches) == 16  # the guard took each batch's own ids
    assert seen[0].count(BAD) == 1 and BAD not in seen[1]
    assert all(len(ids) == 16 for ids in seen.values())  # every rank kept its share (a substitute filled the slot)
    reruns = [_events(out, r, "rerun") for r in range(world)]
    bad_rank = next(r for r in range(world) if any(e["samples"] for e in reruns[r]))
    data, flaky, *sick = reruns[0]
    assert data["verdict"] == "data" and data["ranks"] == [bad_rank] and data["reproduced"][str(bad_rank)]
    assert data["peer"] == ({str(bad_rank): True} if peer else {})
    assert reruns[bad_rank][0]["samples"] == [str(BAD)]
    assert (flaky["step"], flaky["verdict"], flaky["ranks"]) == (flaky_step, "transient", [world - 1])
    assert not any(e["verdict"] == "not_rerun" for r in reruns for e in r)
    assert QuarantineList(out).ids() == {str(BAD)}
    skips = [e["step"] for e in _events(out, 0, "skip")]
    assert skips == [data["step"], flaky_step] + ([sick_step] if sick_step is not None else [])
    if sick_step is not None:
        assert [(e["step"], e["verdict"], e["ranks"], e["peer"]) for e in sick] == [
            (sick_step, "suspect_hardware", [world - 1], {str(world - 1): False})]
        warn = [e for e in _events(out, world - 1, "warn") if e["detector"] == "suspect_hardware"]
        assert len(warn) == 1 and warn[0]["host"] in warn[0]["message"]
    else:
        assert not sick


def test_one_process_the_attached_form_reruns_quarantines_and_skips_the_sample_after_a_resume(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    rerun_attached = _drill()
    rerun_attached.run(Accelerator(gradient_accumulation_steps=2), str(tmp_path), "first", flaky_step=6)
    _check_drill(tmp_path, "first", 1, flaky_step=6, peer=False)
    incident = json.loads(next((tmp_path / "vidstab" / "incidents").glob("*/incident.json")).read_text())
    assert incident["bad_sample_ids"] == [str(BAD)] and incident["rerun"]["verdict"] == "data"

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    rerun_attached.run(Accelerator(gradient_accumulation_steps=2), str(tmp_path), "resume", flaky_step=-1)
    seen, matches = _seen(tmp_path, "resume", 1)
    assert list(seen) == [2] and BAD not in seen[2] and len(seen[2]) == 16 and all(matches)


def _unet_micro_batch(k: int) -> dict:
    images = torch.stack([_drill().Images()[i]["images"] for i in (2 * k, 2 * k + 1)])
    return {"sample": images + torch.randn_like(images), "timestep": torch.tensor([10, 500])}


def _lora_transformer():
    """The tiny CogVideoX transformer, frozen, with a LoRA adapter (as train_cogvideox_lora.py builds it)."""
    from peft import LoraConfig
    from tiny_cogvideox import TARGET_MODULES, tiny_transformer

    model = tiny_transformer()
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=TARGET_MODULES))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # away from B = 0, as training moves it
    return model


def _lora_micro_batch(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"hidden_states": torch.randn(2, 3, 4, 2, 2, generator=g), "encoder_hidden_states": torch.randn(2, 8, 16, generator=g),
            "timestep": torch.tensor([10, 500])}


@pytest.mark.parametrize("kind", ["unet", "lora"])
def test_the_rerun_from_the_recorded_output_gradient_gives_the_steps_own_gradient(tmp_path, kind):
    """Forward with the recorded inputs, backward with the recorded output gradient (accumulation 2), on the
    UNet and on a LoRA-wrapped transformer: the gradient the step took, and the loss value the first run had."""
    from accelerate import Accelerator

    import vidstab

    if kind == "lora":
        pytest.importorskip("peft")
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = _drill().tiny_unet() if kind == "unet" else _lora_transformer()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    for k in range(2):
        with acc.accumulate(model):
            inputs = (_unet_micro_batch if kind == "unet" else _lora_micro_batch)(k)
            pred = model(**inputs, return_dict=False)[0]
            acc.backward(torch.nn.functional.mse_loss(pred, torch.randn_like(pred)))
    step_sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    batches = [dict(m.batch) for m in guard.recorder.micro_batches]
    replay_fn, batches, first = guard.rerun._recorded_replay(batches)
    row = guard.rerun._rerun_own(batches, replay_fn, first)
    assert step_sq > 0 and math.isclose(row[4], step_sq, rel_tol=1e-5)  # GRAD_SQ
    assert math.isclose(row[1], row[5], rel_tol=1e-6)  # the rerun's loss is the first run's (LOSS_SUM, FIRST_SUM)
    guard.close()


def test_the_explicit_form_with_a_diffusers_model_reruns_without_a_replay_function_too(tmp_path):
    """guard.backward with the user's own batch (not the model's inputs): the rerun runs the model's recorded
    inputs; a NaN sample is data, named by the user's ids; a clean step after it is not re-run."""
    from accelerate import Accelerator

    import vidstab

    acc = Accelerator(cpu=True)
    model = _drill().tiny_unet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    verdicts = []
    for step in range(2):
        batch = {"latents": torch.randn(2, 3, 8, 8), "ids": [f"clip{step}-{i}" for i in range(2)]}
        if step == 0:
            batch["latents"][1, 0, 0, 0] = float("nan")
        noise = torch.randn_like(batch["latents"])
        pred = model(batch["latents"] + noise, torch.tensor([10, 500]), return_dict=False)[0]
        guard.backward(torch.nn.functional.mse_loss(pred, noise), batch={"latents": batch["latents"]},
                       sample_ids=batch["ids"])
        verdicts.append(guard.step(1.0).rerun)
    guard.close()
    assert verdicts[0].verdict == "data" and verdicts[0].samples == ["clip0-1"] and verdicts[1] is None
    assert QuarantineList(tmp_path).ids() == {"clip0-1"}


def test_where_it_cannot_rerun_the_attached_form_is_told_what_to_pass_once(tmp_path, caplog):
    """A model the guard records nothing for (not a diffusers one): not_rerun names set_replay_fn and the model's
    forward arguments, printed once; under DeepSpeed the reason is the engine (nothing to pass)."""
    from accelerate import Accelerator

    import vidstab

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    verdicts = []
    caplog.set_level("WARNING", logger="vidstab.recovery.rerun")
    for step in range(4):
        x = torch.randn(2, 4)
        x[0, 0] = float("nan") if step else x[0, 0]
        if step == 3:
            guard.rerun.not_rerun = ZeroEngine.not_rerun  # the engine's own refusal, without building one
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        verdicts.append(guard.last_result.rerun)
    guard.close()
    assert verdicts[0] is None and {v.verdict for v in verdicts[1:]} == {"not_rerun"}
    assert "guard.set_replay_fn(fn) with loss = fn(batch)" in verdicts[1].message and "(input)" in verdicts[1].message
    assert "DeepSpeed" in verdicts[3].message and "set_replay_fn" not in verdicts[3].message
    said = [r.getMessage() for r in caplog.records if "not re-run" in r.getMessage()]
    assert len(said) == 2 and "set_replay_fn" in said[0] and "DeepSpeed" in said[1]  # each reason once


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rerun_attached")
    launch("rerun_attached.py", "--run", f"{out / 'ddp'}:first", "--flaky_step", "2", "--sick_step", "3", timeout=600)
    launch("rerun_attached.py", "--run", f"{out / 'ddp'}:resume", "--run", f"{out / 'fsdp'}:fsdp", "--flaky_step", "2",
           timeout=600)
    return out


@pytest.mark.slow
def test_ddp_data_transient_and_suspect_hardware_and_the_sample_gone_after_a_resume(two_process_runs):
    out = two_process_runs / "ddp"
    _check_drill(out, "first", 2, flaky_step=2, peer=True, sick_step=3)
    seen, matches = _seen(out, "resume", 2)
    assert list(seen) == [2] and BAD not in seen[2] and len(seen[2]) == 16 and all(matches)


@pytest.mark.slow
def test_fsdp2_every_rank_reruns_together_data_and_transient(two_process_runs):
    _check_drill(two_process_runs / "fsdp", "fsdp", 2, flaky_step=2, peer=False)


def test_track_samples_names_each_batch_with_loader_workers_and_refuses_an_iterable_data_set(tmp_path):
    """The ids come from the batch sampler in the main process, so workers prefetching ahead do not shift them; a
    quarantined index is served by its substitute under the substitute's id; an iterable data set is refused."""
    from accelerate import Accelerator

    import vidstab

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [{"x": torch.full((2,), float(i)), "index": i} for i in range(12)]
    loader = torch.utils.data.DataLoader(data, batch_size=3, shuffle=True, num_workers=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    QuarantineList(tmp_path).add([4], "named bad", source="user")
    loader = guard.track_samples(loader)
    for epoch in range(2):
        for batch in loader:
            assert guard.patches.sample_ids == [str(int(i)) for i in batch["index"]]
            assert 4 not in batch["index"].tolist()

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(4)

    with pytest.raises(ValueError, match="not map-style"):
        guard.track_samples(torch.utils.data.DataLoader(Stream(), batch_size=2))
    guard.close()
