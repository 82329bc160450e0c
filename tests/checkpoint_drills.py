"""Damaged-state drills for vidstab checkpoints: each one builds a real checkpoint folder with real files,
damages it the way shared storage, other people or the clock do, and runs the real component on it.

A drill is a function ``drill(workdir: Path) -> str``: it raises ``AssertionError`` (with what went
wrong) when vidstab mishandles the case and returns one line saying what it checked. ``DRILLS`` lists
them all; ``tests/test_checkpoint_safety.py`` runs each as a test and ``benchmarks/bench_chaos.py``
counts them (section "drills"), so none of these regresses unnoticed.

Cases: manifest names reaching outside the folder (``..``, absolute paths,
symbolic links, FIFOs, devices), sizes checked before reading, unreadable pointer and manifest bytes,
the clock stepped back (order comes from the step), a damaged checkpoint that cannot be moved aside, a
resume on another world size, "no such checkpoint", and the damage that already fell back before
(truncated, bit-flipped, missing files).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager, verify_checkpoint_files

HANG_LIMIT_S = 60.0
"""A drill whose component does not return within this long has hung (e.g. blocked on a FIFO); this is
a guard against blocking CI forever, not a timing assertion."""


# ---------------------------------------------------------------------------------------------- helpers
def checkpoint_root(output_dir: Path) -> Path:
    """Where vidstab keeps the checkpoints of the run in ``output_dir`` by default."""
    return Path(output_dir) / CheckpointConfig().subdir


def fresh_accelerator() -> Accelerator:
    """A new CPU ``Accelerator`` (a process-wide singleton: reset first, as tests/conftest.py does)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


class Trainee:
    """A tiny model + AdamW + scheduler trained a step at a time, checkpointed by a real manager."""

    def __init__(self, out: Path, config: CheckpointConfig | None = None, seed: int = 0, frozen: bool = False):
        self.acc = fresh_accelerator()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        if frozen:  # a frozen base (e.g. a pretrained backbone) with a trainable head, as in a LoRA fine-tune
            model[0].requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        self.ckpt = CheckpointManager(self.acc, str(out), config or CheckpointConfig(keep=3, async_save=False))
        self.ckpt.register("model", self.model)
        self.ckpt.register("optimizer", self.opt)
        self.ckpt.register("lr_scheduler", self.sched)
        self.step = 0

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            x = torch.randn(4, 8)
            loss = self.model(x).square().mean()
            self.acc.backward(loss)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.step += 1

    def save(self, healthy: bool = True) -> str:
        path = self.ckpt.save(self.step, healthy=healthy, trainer_state={"step": self.step})
        self.ckpt.wait()
        return path

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.acc.unwrap_model(self.model).state_dict().items()}

    def folder(self, step: int) -> Path:
        return Path(self.ckpt.root) / f"step_{step:06d}"


def train_and_save(out: Path, steps: list[int], **kw) -> Trainee:
    """A run that saved a checkpoint at each of ``steps`` (increasing)."""
    t = Trainee(out, **kw)
    for s in steps:
        t.train(s - t.step)
        t.save()
    return t


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_bytes())


def write_manifest(folder: Path, man: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(man))


def crc_entry(data: bytes) -> dict:
    """A manifest entry with the right size and CRC-32 for ``data``, as vidstab writes them."""
    return {"bytes": len(data), "crc32": f"0x{zlib.crc32(data):08x}"}


def without_hanging(fn: Callable[[], object], what: str) -> object:
    """Run ``fn`` in a thread; fail the drill (instead of blocking forever) if it does not return."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=target, daemon=True, name=f"drill-{what}")
    th.start()
    th.join(HANG_LIMIT_S)
    if th.is_alive():
        raise AssertionError(f"{what} did not return within {HANG_LIMIT_S:.0f}s (blocked reading?)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def expect_error(fn: Callable[[], object], *needles: str) -> str:
    """``fn`` raises CheckpointError whose message contains every needle; returns the message."""
    try:
        fn()
    except CheckpointError as e:
        msg = str(e)
    else:
        raise AssertionError(f"no CheckpointError; expected one mentioning {needles}")
    for n in needles:
        assert n in msg, f"message lacks {n!r}: {msg}"
    return msg


def assert_fell_back(t: Trainee, bad_step: int, good_step: int, *needles: str) -> str:
    """``load("latest")`` skips the damaged ``bad_step``, loads ``good_step``, and says why."""
    state = without_hanging(lambda: t.ckpt.load("latest"), "load('latest')")
    assert state is not None and state["step"] == good_step, f"loaded {state and state['step']}, expected {good_step}"
    reasons = [r for p, r in state["_checkpoint"]["skipped"] if p.endswith(f"step_{bad_step:06d}")]
    assert reasons, f"step_{bad_step:06d} not reported as skipped: {state['_checkpoint']['skipped']}"
    for n in needles:
        assert n in reasons[0], f"skip reason lacks {n!r}: {reasons[0]}"
    return reasons[0]


def assert_refused(t: Trainee, bad_step: int, good_step: int, *needles: str) -> str:
    """Both readers refuse the damaged ``bad_step`` without hanging: ``load("latest")`` falls back to
    ``good_step`` and ``verify_checkpoint_files`` raises, each naming the problem (``needles``)."""
    reason = assert_fell_back(t, bad_step, good_step, *needles)
    without_hanging(lambda: expect_error(lambda: verify_checkpoint_files(t.folder(bad_step)), *needles),
                    "verify_checkpoint_files")
    return reason


@contextlib.contextmanager
def clock_stepped_back(seconds: float):
    """The wall clock jumps back ``seconds`` (NTP correction, a job moved to another node) for the block."""
    real = time.time
    time.time = lambda: real() - seconds
    try:
        yield
    finally:
        time.time = real


def unremovable(path: Path) -> Callable[[], None] | None:
    """Make the folder ``path`` impossible to rename or delete, as an immutable file or a read-only bind
    mount does (``chattr +i``, which needs root and a file system that supports it). Returns the undo, or
    None when this machine cannot do it (the drill is then skipped)."""
    if os.geteuid() != 0 or not shutil.which("chattr"):
        return None
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        return None
    return lambda: subprocess.run(["chattr", "-i", str(path)], capture_output=True)


class DrillSkipped(Exception):
    """This machine cannot stage the drill (e.g. no way to make a folder unremovable)."""


# ---------------------------------------------------------------------------------------------- drills
def drill_manifest_parent_escape(work: Path) -> str:
    """A manifest entry ``../../outside.bin`` with the right size and CRC is refused; the outside file's
    size never appears in the message."""
    t = train_and_save(work / "run", [2, 4])
    outside = work / "outside.bin"
    data = (t.folder(4) / "model.safetensors").read_bytes()
    outside.write_bytes(data)
    man = manifest(t.folder(4))
    del man["files"]["model.safetensors"]
    rel = os.path.relpath(outside, t.folder(4))
    man["files"][rel] = crc_entry(data)
    write_manifest(t.folder(4), man)
    reason = assert_refused(t, 4, 2, "not a plain file name")
    assert str(len(data)) not in reason, f"message leaks the outside file's size: {reason}"
    return f"'..' entry refused: {reason}"


def drill_manifest_absolute_path(work: Path) -> str:
    """An absolute path in a manifest (e.g. ``/dev/zero`` with ``bytes: 0``) is refused before anything is
    opened: no MemoryError, no endless read."""
    t = train_and_save(work / "run", [2, 4])
    man = manifest(t.folder(4))
    man["files"]["/dev/zero"] = {"bytes": 0, "crc32": "0x00000000"}
    write_manifest(t.folder(4), man)
    reason = assert_refused(t, 4, 2, "not a plain file name", "/dev/zero")
    return f"absolute entry refused: {reason}"


def drill_symlinked_file(work: Path) -> str:
    """A file of the checkpoint replaced by a symbolic link (to an identical copy elsewhere) is refused."""
    t = train_and_save(work / "run", [2, 4])
    f = t.folder(4) / "model.safetensors"
    copy = work / "elsewhere.safetensors"
    shutil.copyfile(f, copy)
    f.unlink()
    f.symlink_to(copy)
    reason = assert_refused(t, 4, 2, "model.safetensors", "symbolic link")
    # A sub-folder (as the sharded backend's dcp/) that is a link to a folder elsewhere: refused too.
    t = train_and_save(work / "run2", [2, 4])
    (work / "outside").mkdir()
    (work / "outside" / "extra.json").write_bytes(b"{}")
    (t.folder(4) / "sub").symlink_to(work / "outside", target_is_directory=True)
    man = manifest(t.folder(4))
    man["files"]["sub/extra.json"] = crc_entry(b"{}")
    write_manifest(t.folder(4), man)
    assert_refused(t, 4, 2, "sub/extra.json", "symbolic link")
    return f"link refused: {reason}"


def drill_fifo_file(work: Path) -> str:
    """A file replaced by a FIFO: load and verify refuse it instead of blocking forever."""
    t = train_and_save(work / "run", [2, 4])
    f = t.folder(4) / "optimizer.json"
    f.unlink()
    os.mkfifo(f)
    reason = assert_refused(t, 4, 2, "optimizer.json", "not a regular file")
    return f"FIFO refused: {reason}"


def drill_fifo_manifest_and_pointer(work: Path) -> str:
    """``manifest.json`` and the ``latest`` pointer replaced by FIFOs: treated as damaged, never read."""
    t = train_and_save(work / "run", [2, 4])
    (t.folder(4) / "manifest.json").unlink()
    os.mkfifo(t.folder(4) / "manifest.json")
    latest = Path(t.ckpt.root) / "latest"
    latest.unlink()
    os.mkfifo(latest)
    state = without_hanging(lambda: t.ckpt.load("latest"), "load('latest')")
    assert state["step"] == 2, state["_checkpoint"]
    without_hanging(lambda: expect_error(lambda: verify_checkpoint_files(t.folder(4)), "manifest"),
                    "verify_checkpoint_files")
    assert without_hanging(t.ckpt.list, "list()") is not None
    return "FIFO manifest and pointer: fell back to step 2"


def drill_device_file(work: Path) -> str:
    """A checkpoint file that is a character device (``/dev/zero``-like, size 0) is refused, not read."""
    t = train_and_save(work / "run", [2, 4])
    f = t.folder(4) / "trainer.json"
    f.unlink()
    try:
        os.mknod(f, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
        kind = "character device"
    except (PermissionError, OSError):
        f.symlink_to("/dev/zero")  # unprivileged: the same file reached through a link
        kind = "link to /dev/zero"
    man = manifest(t.folder(4))
    man["files"]["trainer.json"] = {"bytes": 0, "crc32": "0x00000000"}
    write_manifest(t.folder(4), man)
    reason = assert_refused(t, 4, 2, "trainer.json")
    return f"{kind} refused: {reason}"


def drill_size_checked_before_reading(work: Path) -> str:
    """A file far larger than its manifest entry says is refused from its size alone."""
    t = train_and_save(work / "run", [2, 4])
    f = t.folder(4) / "model.safetensors"
    with open(f, "ab") as fh:
        fh.truncate(f.stat().st_size + (64 << 20))  # sparse: costs no disk, would cost 64 MiB to read
    reason = assert_fell_back(t, 4, 2, "model.safetensors", "bytes, manifest says")
    return f"oversized file refused: {reason}"


def drill_pointer_bad_bytes(work: Path) -> str:
    """Non-UTF-8 bytes (and other garbage) in ``latest`` / ``last_good``: treated as damaged pointers; the
    newest valid checkpoint by step is loaded."""
    t = train_and_save(work / "run", [2, 4])
    root = Path(t.ckpt.root)
    seen = []
    for garbage in (b"\xff\xfe\x00step_000004\n", b"\x80" * 300, b"step_000002" * 10000, b""):
        (root / "latest").write_bytes(garbage)
        (root / "last_good").write_bytes(garbage)
        for which in ("latest", "last_good"):
            state = without_hanging(lambda: t.ckpt.load(which), f"load({which!r})")
            assert state is not None and state["step"] == 4, f"{which} with {garbage[:12]!r}: {state}"
        assert t.ckpt.latest_valid() is not None and t.ckpt.last_good() is not None
        assert t.ckpt.latest_path_str() is None or "step_" in t.ckpt.latest_path_str()
        seen.append(len(garbage))
    t.train(2)
    t.save()  # a save replaces the damaged pointers
    assert (root / "latest").read_text().strip() == "step_000006"
    return f"{len(seen)} kinds of pointer garbage: loaded step 4 each time, next save repaired them"


def drill_manifest_bad_bytes(work: Path) -> str:
    """A manifest of non-UTF-8 bytes or of the wrong JSON shape is damaged: skipped with a message."""
    t = train_and_save(work / "run", [2, 4])
    good = (t.folder(4) / "manifest.json").read_bytes()
    bad_manifests = [b"\xff\xfe{\x00", b"[1, 2]", b'{"schema": 1, "step": "x", "files": {}}',
                     b'{"schema": 1, "step": 4, "files": ["model.safetensors"]}',
                     b'{"schema": 1, "step": 4, "files": {"model.safetensors": 7}}',
                     b'{"schema": 1, "step": true, "files": {}}', b'{"schema": 1, "step": 4, "files": {"": {"bytes": 1}}}']
    for raw in bad_manifests:
        (t.folder(4) / "manifest.json").write_bytes(raw)
        state = without_hanging(lambda: t.ckpt.load("latest"), "load('latest')")
        assert state["step"] == 2, f"manifest {raw[:30]!r}: loaded {state['step']}"
        assert 4 not in [i.step for i in t.ckpt.list()], f"{raw!r} listed as a checkpoint of step 4"
        expect_error(lambda: verify_checkpoint_files(t.folder(4)), "step_000004")
    (t.folder(4) / "manifest.json").write_bytes(good)
    assert t.ckpt.load("latest")["step"] == 4
    return f"{len(bad_manifests)} malformed manifests skipped; the intact one loads again"


def drill_clock_stepped_back(work: Path) -> str:
    """The clock steps back an hour mid-run: rotation keeps the newest steps and fallback goes to the
    newest valid step (it used to delete steps 8 and 10 and then find no valid checkpoint)."""
    t = Trainee(work / "run", CheckpointConfig(keep=3, async_save=False))
    for s in (2, 4, 6):
        t.train(2)
        t.save()
    with clock_stepped_back(3600):
        for s in (8, 10, 12):
            t.train(2)
            t.save()
    names = sorted(i.name for i in t.ckpt.list())
    assert names == ["step_000008", "step_000010", "step_000012"], f"rotation kept {names}"
    f = t.folder(12) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-9])
    reason = assert_fell_back(t, 12, 10, "truncated")
    assert t.ckpt.latest_valid().endswith("step_000010")
    return f"kept {names}; with step 12 damaged loaded step 10"


def drill_order_after_rollback(work: Path) -> str:
    """After a rollback from step 8 to step 4 and a save at step 5, the abandoned steps 6 and 8 are never
    'latest' -- even with the pointer damaged and their manifests' times ahead of the new save's -- and a
    fallback goes along the new trajectory (5 -> 4), not to them."""
    t = train_and_save(work / "run", [2, 4, 6, 8], config=CheckpointConfig(keep=3, async_save=False))
    for s in (6, 8):  # the clock of the abandoned saves was ahead: by time they look newer than what follows
        man = manifest(t.folder(s))
        man["time"] += 7200
        write_manifest(t.folder(s), man)
    state = t.ckpt.load(str(t.folder(4)))  # what vidstab.Recovery does on a rollback
    t.ckpt.set_latest(state["_checkpoint"]["path"])
    t.ckpt.set_last_good(state["_checkpoint"]["path"])
    t.step = 4
    t.train(1)
    t.save()
    names = sorted(i.name for i in t.ckpt.list())
    assert {"step_000004", "step_000005"} <= set(names), f"rotation dropped the new trajectory: {names}"
    root = Path(t.ckpt.root)
    for ptr in ("latest", "last_good"):
        (root / ptr).write_bytes(b"\xff\xfe")
        state = t.ckpt.load(ptr)
        assert state["step"] == 5, f"{ptr} damaged: loaded step {state['step']} instead of 5"
    f = t.folder(5) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    state = t.ckpt.load("latest")
    assert state["step"] == 4, f"step 5 damaged: loaded step {state['step']} instead of 4"
    return f"kept {names}; damaged pointers -> step 5; step 5 damaged -> step 4"


def drill_damaged_unmovable(work: Path) -> str:
    """A damaged checkpoint that cannot be moved aside (immutable / read-only): the resume falls back, and
    the save of the same step goes to another folder with a message naming what to clean up."""
    t = train_and_save(work / "run", [2, 4])
    f = t.folder(4) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    undo = unremovable(t.folder(4))
    if undo is None:
        raise DrillSkipped("cannot make a folder unremovable here")
    try:
        t2 = Trainee(work / "run")
        state = t2.ckpt.load("latest")
        assert state["step"] == 2
        t2.step = 2
        t2.train(2)
        log = logging.getLogger("vidstab.checkpoint")
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda r: records.append(r.getMessage())
        log.addHandler(handler)
        try:
            path = t2.save()  # must not raise
        finally:
            log.removeHandler(handler)
        assert Path(path).name != "step_000004" and Path(path).is_dir(), path
        text = " ".join(records)
        assert "step_000004" in text and "remove" in text, f"no clean-up message: {records}"
        want = t2.weights()
        t3 = Trainee(work / "run")
        assert t3.ckpt.load("latest")["step"] == 4
        got = t3.weights()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        t3.train(2)
        t3.step = 6
        t3.save()  # later saves and their rotation keep working around it
    finally:
        undo()
    return f"saved step 4 as {Path(path).name}; message: {text[:120]}"


def drill_every_manifest_gone(work: Path) -> str:
    """Every ``manifest.json`` and both pointers gone: ``load("latest")`` refuses, naming each folder it cannot
    verify, instead of "no checkpoint, starting from scratch"; a later save of one of those steps moves the
    folder to ``unverified-step_*`` with every byte kept, never replaces it."""
    t = train_and_save(work / "run", [2, 4, 6])
    before = {p.relative_to(t.ckpt.root): p.read_bytes() for p in Path(t.ckpt.root).rglob("*.safetensors")}
    for step in (2, 4, 6):
        (t.folder(step) / "manifest.json").unlink()
    for ptr in ("latest", "last_good"):
        (Path(t.ckpt.root) / ptr).unlink()
    t2 = Trainee(work / "run")
    msg = expect_error(lambda: t2.ckpt.load("latest"), "cannot be verified", "step_000002", "step_000004",
                       "step_000006", "no manifest.json", "--overwrite_output_dir")
    expect_error(lambda: t2.ckpt.load("last_good"), "cannot be verified")
    t2.train(4)
    t2.save()  # the same step as the unverifiable step_000004
    root = Path(t.ckpt.root)
    kept = root / "unverified-step_000004"
    assert kept.is_dir() and (root / "step_000004" / "manifest.json").is_file()
    after = {Path(str(p.relative_to(root)).replace("unverified-", "")): p.read_bytes()
             for p in root.rglob("*.safetensors") if not str(p.relative_to(root)).startswith("step_000004")}
    assert after == before, "a folder that could not be verified lost or changed a file"
    return f"refused: {msg[:150]}; step_000004 kept as {kept.name}"


def drill_oversized_or_deep_state_json(work: Path) -> str:
    """``optimizer.json`` replaced by a file beyond the JSON cap, and ``scheduler.json`` by one nested
    200,000 deep, each with a matching manifest entry (size and checksum): refused before parsing, naming the
    file and the setting, and the resume falls back to the intact checkpoint."""
    out = []
    for target, content in (("optimizer.json", b'{"pad": "' + b"x" * 3_000_000 + b'"}'),
                            ("scheduler.json", b"[" * 200_000 + b"]" * 200_000)):
        t = train_and_save(work / target, [2, 4])
        (t.folder(4) / target).write_bytes(content)
        man = manifest(t.folder(4))
        man["files"][target] = crc_entry(content)
        write_manifest(t.folder(4), man)
        before = os.environ.get("VIDSTAB_MAX_JSON_BYTES")
        os.environ["VIDSTAB_MAX_JSON_BYTES"] = str(1 << 20)
        try:
            reason = assert_fell_back(t, 4, 2, target, "VIDSTAB_MAX_JSON_BYTES" if target == "optimizer.json" else "nested")
        finally:
            if before is None:
                os.environ.pop("VIDSTAB_MAX_JSON_BYTES")
            else:
                os.environ["VIDSTAB_MAX_JSON_BYTES"] = before
        out.append(reason[:90])
    return "; ".join(out)


def drill_world_size_changed(work: Path) -> str:
    """A checkpoint written by 2 processes is refused by a 1-process resume with a message that says why
    and what to do; every candidate would be refused the same way, so it does not fall back."""
    t = train_and_save(work / "run", [2, 4])
    for s in (2, 4):
        man = manifest(t.folder(s))
        man["world_size"] = 2  # what a 2-process save records
        write_manifest(t.folder(s), man)
    t2 = Trainee(work / "run")
    before = t2.weights()
    msg = expect_error(lambda: t2.ckpt.load("latest"), "2 processes", "1", "world size")
    after = t2.weights()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "weights changed by a refused load"
    t3 = Trainee(work / "run", CheckpointConfig(keep=3, async_save=False, allow_world_size_change=True))
    assert t3.ckpt.load("latest")["step"] == 4
    return f"refused: {msg[:160]}"


def drill_no_such_checkpoint(work: Path) -> str:
    """``--resume_from_checkpoint /no/such/path`` / ``lates`` / ``checkpoint-4``: "no such checkpoint",
    listing what exists, instead of "no manifest.json (incomplete save)"."""
    t = train_and_save(work / "run", [2, 4])
    msgs = []
    for which in ("/no/such/path", "lates", "checkpoint-4", "step_000099"):
        msg = expect_error(lambda: t.ckpt.load(which), "no such checkpoint", which, "step_000002", "step_000004")
        assert "incomplete save" not in msg, msg
        msgs.append(msg)
    return msgs[1][:160]


def drill_classic_damage(work: Path) -> str:
    """The cases that already passed: truncated, bit-flipped and deleted files and a missing manifest fall
    back to the previous checkpoint, which loads bitwise."""
    out = []
    for kind in ("truncate", "bitflip", "delete", "no_manifest"):
        t = train_and_save(work / kind, [2])
        want = t.weights()
        t.train(2)
        t.save()
        folder = t.folder(4)
        f = folder / "model.safetensors"
        if kind == "truncate":
            f.write_bytes(f.read_bytes()[:-7])
        elif kind == "bitflip":
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x10
            f.write_bytes(bytes(data))
        elif kind == "delete":
            (folder / "optimizer.safetensors").unlink()
        else:
            (folder / "manifest.json").unlink()
        state = t.ckpt.load("latest")
        assert state["step"] == 2, (kind, state)
        got = t.weights()
        assert all(torch.equal(got[k], v) for k, v in want.items()), kind
        out.append(kind)
    return "fell back bitwise after " + ", ".join(out)


def diffusers_scan(output_dir: Path) -> list[str]:
    """How diffusers' training examples find their checkpoints (``train_unconditional.py``,
    ``train_cogvideox_lora.py``: ``--resume_from_checkpoint latest`` and ``--checkpoints_total_limit``)."""
    dirs = [d for d in os.listdir(output_dir) if d.startswith("checkpoint")]
    return sorted(dirs, key=lambda x: int(x.split("-")[1]))


def drill_accelerate_and_diffusers_coexist(work: Path) -> str:
    """vidstab's default checkpoint folder lives beside Accelerate's automatic naming + ``total_limit``
    (``save_state``/``load_state``) and diffusers' ``checkpoint-N`` scan in the same output dir."""
    from accelerate.utils import ProjectConfiguration

    out = work / "auto"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(out), automatic_checkpoint_naming=True, total_limit=2))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ckpt = CheckpointManager(acc, str(out), CheckpointConfig(async_save=False))
    ckpt.register("model", model)
    for step in range(1, 5):
        acc.backward(model(torch.randn(2, 4)).square().mean())
        opt.step()
        opt.zero_grad()
        ckpt.save(step, trainer_state={"step": step})
        acc.save_state()  # Accelerate's own rotation (total_limit=2) runs here
    acc.load_state()
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint_2", "checkpoint_3"], os.listdir(out / "checkpoints")
    assert ckpt.load("latest")["step"] == 4

    out2 = work / "diffusers"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(out2)))
    model, opt = acc.prepare(torch.nn.Linear(4, 4), torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1))
    ckpt = CheckpointManager(acc, str(out2), CheckpointConfig(async_save=False))
    ckpt.register("model", model)
    for step in (2, 4):
        ckpt.save(step, trainer_state={"step": step})
        acc.save_state(str(out2 / f"checkpoint-{step}"))
    found = diffusers_scan(out2)
    assert found == ["checkpoint-2", "checkpoint-4"], found
    acc.load_state(str(out2 / found[-1]))
    assert ckpt.load("latest")["step"] == 4
    return f"vidstab in {os.path.relpath(ckpt.root, out2)}; Accelerate rotation and diffusers scan unaffected"


def drill_bundle_weights_reachable_or_refused(work: Path, sharded: bool = False) -> str:
    """An incident bundle names a checkpoint. Rotation keeps it (``keep_for_incidents``), and when
    a rollback saves that step again with other weights, ``vidstab replay`` refuses the bundle with a
    message instead of replaying on weights the incident never saw. ``sharded``: the same with DCP shards
    (what an FSDP2 run writes), which replay reads into its one plain model."""
    from vidstab.evidence.capture import write_incident
    from vidstab.reference.model import VideoDiT
    from vidstab.reference.objective import DiffusionObjective, step_generator
    from vidstab.tools.replay import ReplayError, replay

    out = work / "run"
    acc = fresh_accelerator()
    torch.manual_seed(0)
    model = acc.prepare(VideoDiT(in_channels=4, hidden_size=16, num_layers=1, num_heads=2))
    with torch.no_grad():  # leave AdaLN-Zero's all-zero start, as a trained model has
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(std=0.05)
    ckpt = CheckpointManager(acc, str(out), CheckpointConfig(keep=1, async_save=False, sharded=sharded))
    ckpt.register("model", model)
    ckpt.save(2)
    latents = torch.randn(2, 4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    latents[1, :, 0] = float("nan")
    batch = {"latents": latents, **DiffusionObjective().sample(latents, step_generator(0, 3, 0, 0))}
    spec = {"class": "vidstab.reference.model:VideoDiT", "config": dict(acc.unwrap_model(model).config),
            "loss_fn": "vidstab.reference.objective:replay_loss", "loss_fn_kwargs": {"prediction_type": "epsilon"}}
    bundle = write_incident(out, step=3, micro_step=0, rank=0, world_size=1, batch=batch, sample_ids=["a", "b"],
                            finding={"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN", "figures": {}},
                            lr=1e-4, precision="no", seed=0, checkpoint=ckpt.latest_path_str(), model_spec=spec)
    for step in (4, 6, 8):  # keep=1: without the bundle's claim, step 2 would be rotated away
        ckpt.save(step)
    names = sorted(i.name for i in ckpt.list())
    assert "step_000002" in names and "step_000004" not in names, f"rotation kept {names}"
    assert replay(bundle).reproduced is True
    ckpt.load(str(Path(ckpt.root) / "step_000002"))  # a rollback to step 2 ...
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # ... that trains on differently
    ckpt.save(2)
    try:
        replay(bundle)
    except ReplayError as e:
        msg = str(e)
    else:
        raise AssertionError("replay ran on a checkpoint rewritten after the incident")
    assert "rewritten after the incident" in msg and "--checkpoint" in msg, msg
    return f"rotation kept {names}; after the rewrite: {msg[:120]}"


def drill_frozen_base_weights(work: Path) -> str:
    """With frozen parameters (a LoRA-style fine-tune's base), a checkpoint holds only what
    training changes plus a fingerprint of the frozen weights; a resume onto the same base restores the
    trained part bitwise, a resume onto other base weights is refused with a message that says so."""
    from safetensors import safe_open

    full = train_and_save(work / "full", [2])
    t = train_and_save(work / "run", [2], frozen=True)
    want = t.weights()
    with safe_open(str(t.folder(2) / "model.safetensors"), "pt") as fh:
        keys, meta = set(fh.keys()), fh.metadata()
    assert keys == {"2.weight", "2.bias"}, f"saved {sorted(keys)}"
    assert "vidstab_frozen" in meta, meta
    small, big = ((x.folder(2) / "model.safetensors").stat().st_size for x in (t, full))
    assert small < big, (small, big)
    same = Trainee(work / "run", frozen=True, seed=0)  # the same base weights (same seed)
    assert same.ckpt.load("latest")["step"] == 2
    got = same.weights()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    other = Trainee(work / "run", frozen=True, seed=1)  # another base model
    before = other.weights()
    msg = expect_error(lambda: other.ckpt.load("latest"), "other frozen (base) weights", "same base model")
    after = other.weights()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused load changed weights"
    return f"model.safetensors {small} B instead of {big} B; other base: {msg[:140]}"


def drill_resume_event(work: Path) -> str:
    """A loop that resumes through ``CheckpointManager.load`` gets a ``resume`` event naming the
    checkpoint (and what was skipped); a rollback's load logs ``rollback``, not ``resume``."""
    from vidstab.recovery.policy import Recovery

    out = work / "run"
    train_and_save(out, [2, 4])
    f = Path(checkpoint_root(out)) / "step_000004" / "optimizer.json"
    f.write_bytes(f.read_bytes()[:-1])
    t = Trainee(out)
    t.ckpt.load("latest")
    log = out / "vidstab" / "events-rank0.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    resumes = [r for r in rows if r["kind"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 2, resumes
    assert resumes[0]["checkpoint"] == "vidstab/checkpoints/step_000002", resumes[0]
    assert "step_000004" in json.dumps(resumes[0]["skipped"])
    Recovery(t.acc, t.ckpt, run_dir=str(out)).rollback("drill", 3)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["kind"] for r in rows].count("resume") == 1 and rows[-1]["kind"] == "rollback", rows[-2:]
    return f"resume event: {resumes[0]['checkpoint']} (skipped step_000004); rollback logged as rollback"


DRILLS: dict[str, Callable[[Path], str]] = {
    "manifest_parent_escape": drill_manifest_parent_escape,
    "manifest_absolute_path": drill_manifest_absolute_path,
    "symlinked_file": drill_symlinked_file,
    "fifo_file": drill_fifo_file,
    "fifo_manifest_and_pointer": drill_fifo_manifest_and_pointer,
    "device_file": drill_device_file,
    "size_checked_before_reading": drill_size_checked_before_reading,
    "pointer_bad_bytes": drill_pointer_bad_bytes,
    "manifest_bad_bytes": drill_manifest_bad_bytes,
    "clock_stepped_back": drill_clock_stepped_back,
    "order_after_rollback": drill_order_after_rollback,
    "damaged_unmovable": drill_damaged_unmovable,
    "world_size_changed": drill_world_size_changed,
    "every_manifest_gone": drill_every_manifest_gone,
    "oversized_or_deep_state_json": drill_oversized_or_deep_state_json,
    "no_such_checkpoint": drill_no_such_checkpoint,
    "classic_damage": drill_classic_damage,
    "accelerate_and_diffusers_coexist": drill_accelerate_and_diffusers_coexist,
    "bundle_weights_reachable_or_refused": drill_bundle_weights_reachable_or_refused,
    "bundle_weights_reachable_or_refused_sharded": lambda work: drill_bundle_weights_reachable_or_refused(work, sharded=True),
    "frozen_base_weights": drill_frozen_base_weights,
    "resume_event": drill_resume_event,
}
"""Every drill, by name (the name is what the benchmark and the tests report)."""


def run_drill(name: str, workdir: Path) -> dict:
    """Run one drill in ``workdir``: ``{"drill", "ok" (None: skipped), "detail"}`` (never raises)."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        detail = DRILLS[name](workdir)
        ok = True
    except DrillSkipped as e:
        detail, ok = f"skipped: {e}", None
    except Exception as e:  # noqa: BLE001 - a failed drill is a result to count, not a crash
        detail, ok = f"{type(e).__name__}: {e}", False
    return {"drill": name, "ok": ok, "detail": str(detail)[:300]}
