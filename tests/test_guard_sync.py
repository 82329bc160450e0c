"""No hidden host sync in the guarded step: counted on CPU, enforced by CUDA's sync debug mode on a GPU.

On CPU nothing is physically transferred, so the counter records every call that WOULD move data between
host and device on an accelerator: Python-level reads (``item``, ``tolist``, ``bool()``, ``float()``,
``numpy``, ``cpu`` ...), ``aten::_local_scalar_dense`` (the op behind every implicit read, e.g. in C++),
host data becoming a tensor (``aten::lift_fresh``: ``torch.tensor``, ``torch.from_numpy``, ...) and any
``_to_copy``/``copy_`` between devices. The guard's budget per optimizer step: one read of the gathered
summary, nothing per micro-step (the rank's host-known values become device values by fills, not uploads).
Between that read and the optimizer step nothing else runs: reporting, tracker logging and the event log
come after it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pytest

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class TransferCounter(TorchDispatchMode):
    """Counts would-be device<->host transfers while active (observes only: the originals still run)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    def _hit(self, kind: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self._hit("d2h:_local_scalar_dense")
        elif name == "lift_fresh":
            self._hit("h2d:lift_fresh")
        elif name in ("_to_copy", "copy_"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
            if len(devices) > 1:
                self._hit(f"copy:{name}")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in READS:
            self._wrap(torch.Tensor, name, "d2h:")
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()
        return out

    def _wrap(self, obj, name: str, prefix: str) -> None:
        fn = getattr(obj, name)
        self._saved.append((obj, name, fn))
        counter = self

        def inner(*a, **k):
            counter._hit(prefix + name)
            return fn(*a, **k)

        setattr(obj, name, inner)


def test_the_counter_sees_implicit_reads_and_uploads():
    counter = TransferCounter()
    x = torch.ones(3)
    with counter:
        if x.sum() > 0:  # an implicit read, the kind a hidden sync hides in
            pass
        torch.tensor([1.0, 2.0])
        torch.from_numpy(x.numpy())
        x.tolist()
    assert counter.by_kind.get("d2h:__bool__") == 1 and counter.by_kind.get("d2h:tolist") == 1
    assert counter.by_kind.get("d2h:_local_scalar_dense") == 1 and counter.by_kind.get("h2d:lift_fresh") == 2


def test_the_explicit_guarded_step_of_one_process_reads_one_row(tmp_path):
    from test_guard import TinyDenoiser, make, micro_batch

    acc, model, opt, sched, guard = make(tmp_path, accum=2)
    assert isinstance(model, TinyDenoiser)
    per_call = []
    counter = TransferCounter()

    def micro_step(i: int):
        batch, ids = micro_batch(i)
        with acc.accumulate(model):
            per_sample = ((model(batch["latents"] + batch["noise"], batch["timesteps"]) - batch["noise"]) ** 2).flatten(1).mean(1)
            guard.backward(per_sample.mean(), batch=batch, sample_ids=ids, per_sample_loss=per_sample)
            guard.step(1.0)

    for i in range(4):
        micro_step(i)  # warm-up: first-step allocations
    with counter:
        for i in range(4, 12):
            micro_step(i)
            per_call.append(counter.total())
    deltas = [b - a for a, b in zip([0] + per_call, per_call)]
    assert deltas == [0, 1] * 4, counter.by_kind  # the micro-step reads nothing; the optimizer step one row
    assert counter.by_kind == {"d2h:tolist": 4}


def test_no_sync_in_the_guarded_step_under_cuda_sync_debug_mode(tmp_path):
    if not torch.cuda.is_available():
        print("no CUDA on this machine: torch.cuda.set_sync_debug_mode('error') test skipped")
        pytest.skip("needs CUDA")
    from accelerate import Accelerator

    import vidstab

    acc = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    x = torch.randn(8, 16, device=acc.device)

    def step():
        with acc.accumulate(model):
            loss = model(x).square().mean()
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # The one read of the reduced summary is the guard's only sync: allow exactly that call.
    from vidstab import signals

    read = signals.reduce_and_read

    def allowed_read(*a, **k):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    signals.reduce_and_read = allowed_read
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        signals.reduce_and_read = read
    assert guard.step_count == 8 and guard.skipped_total == 0


def test_recording_and_packing_a_step_take_a_few_dozen_small_device_ops():
    """One micro-step, one input tensor (the unmodified loop's common case): record + pack stay small and fixed."""
    from vidstab import signals

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    window = signals.Window(torch.device("cpu"), buckets=10, num_train_timesteps=1000)
    loss, x, norm = torch.tensor(0.5), torch.randn(2, 4, 8, 8), torch.tensor(1.0)

    def pack():
        return window.pack(norm, stop=False, param_sq=None, update_sq=None, loss_scale=None, seconds=0.01, rank=0)

    window.record(loss, {"sample": x})
    pack()  # the first step of a window shape builds its fixed maps
    window.reset()
    with OpCounter() as rec:
        window.record(loss, {"sample": x})
    recorded = list(rec.ops)
    with OpCounter() as packed:
        vec = pack()
    assert len(recorded) <= 6, recorded  # a detach (view), aminmax, sum, norm
    assert len(packed.ops) <= 40, packed.ops
    layout = signals.Layout(10)
    assert vec.shape == (layout.width,) and vec[layout.grad_norm] == 1.0 and vec[layout.loss_sum] == 0.5


@pytest.mark.parametrize("tracked", [True, False], ids=["log_with-every-step", "no-tracker"])
def test_between_the_host_read_and_the_optimizer_step_runs_nothing_but_the_step(tmp_path, tracked):
    """Reporting, tracker logging and the event log's lines come after the step is enqueued.

    The user's plain loop after ``vidstab.attach``; observed with real components only: the torch optimizer's own
    step pre-hook, an Accelerate tracker given in ``log_with``, and the event log file on disk. With a tracker
    every step takes the full path (judged, reported at once); without one, healthy steps are batched."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.tracking import GeneralTracker

    import vidstab
    from vidstab.events import read_events

    timeline: list[tuple[str, int]] = []

    class TimelineTracker(GeneralTracker):
        name = "timeline"
        requires_logging_directory = False

        @property
        def tracker(self):
            return self

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            if any(k.startswith("vidstab/") for k in values):
                timeline.append(("tracker.log", step))

    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, log_with=[TimelineTracker()] if tracked else None)
    if tracked:
        acc.init_trackers("timeline")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    spike_step = 40  # past the loss detector's warm-up
    findings_on_disk_at_step: dict[int, set[tuple[str, int]]] = {}

    def before_optimizer_step(optimizer, args, kwargs):
        step = guard.step_count
        timeline.append(("optimizer.step", step))
        findings_on_disk_at_step[step] = {(e["kind"], e["step"]) for e in _events_on_disk(tmp_path)
                                          if e["kind"] != "metrics"}

    opt.optimizer.register_step_pre_hook(before_optimizer_step)
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def observed(read):
        def observed_read(self, *a, **k):
            timeline.append(("host read", guard.step_count))
            return read(self, *a, **k)
        return observed_read

    for name, read in originals.items():
        setattr(torch.Tensor, name, observed(read))
    try:
        for i in range(60):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
            with acc.accumulate(model):
                # A loss far above its history, with the usual gradient: a warning, and the step is applied.
                loss = model(x).square().mean() + (100.0 if i == spike_step else 0.0)
                acc.backward(loss)
                acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
    finally:
        for name, read in originals.items():
            setattr(torch.Tensor, name, read)
    guard.close()

    steps = [s for kind, s in timeline if kind == "optimizer.step"]
    assert steps == list(range(60)), "every step applied, the spike's included"
    for k, (kind, step) in enumerate(timeline):
        if kind == "optimizer.step":  # right before it: this step's one host read, nothing else
            assert timeline[k - 1] == ("host read", step), timeline[max(0, k - 3):k + 1]
    if tracked:
        logged = [s for kind, s in timeline if kind == "tracker.log"]
        assert logged == list(range(60))
        assert all(timeline.index(("tracker.log", s)) > timeline.index(("optimizer.step", s)) for s in logged)
    warnings = [(e["kind"], e["step"]) for e in read_events(tmp_path) if e.get("detector") == "loss_spike"]
    assert warnings == [("warn", spike_step)]
    assert ("warn", spike_step) not in findings_on_disk_at_step[spike_step]  # written after the step, flushed at once
    assert ("warn", spike_step) in findings_on_disk_at_step[spike_step + 1]
    assert len(read_events(tmp_path, "metrics")) == 60


def _events_on_disk(run_dir) -> list[dict]:
    """The event log's lines as the file holds them now (no flush: what a crash would leave)."""
    import json

    lines = []
    for path in sorted(run_dir.rglob("events-rank*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines
