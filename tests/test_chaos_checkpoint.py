"""Real faults against real processes: SIGKILL mid-save at precise and random points, SIGTERM preemption.

Every resume must find a complete checkpoint, and the finished run must be bitwise identical to an
uninterrupted one. ``python scripts/chaos_checkpoint.py --kills 20`` runs the long version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from trainer_utils import shared_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "tests", "scripts", "ckpt_train.py")
ARGS = ["--steps", "12", "--hidden", "128", "--keep", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


def _run(out, *extra, check=True):
    r = subprocess.run([sys.executable, TRAIN, "--out", str(out), *ARGS, *extra], capture_output=True, text=True,
                       timeout=120, env=ENV)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


class _Reference:
    """The uninterrupted run, built once per test session (:func:`trainer_utils.shared_run`) in a background
    thread as soon as the first test asks for it: it overlaps that test's own runs (which never read it until
    they compare final weights); :meth:`folder` waits."""

    def __init__(self, tmp_path_factory):
        self.path, self.error = None, None
        self.thread = threading.Thread(target=self._build, args=(tmp_path_factory,), daemon=True)
        self.thread.start()

    def _build(self, tmp_path_factory):
        try:
            self.path = shared_run(tmp_path_factory, "chaos-reference", _run)
        except BaseException as e:  # noqa: BLE001 - raised again in the test that waits for it
            self.error = e

    def folder(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = _Reference(tmp_path_factory)
    yield ref
    ref.thread.join()


def _assert_same_as_reference(run, reference):
    reference = reference.folder()
    a, b = load_file(str(reference / "final.safetensors")), load_file(str(run / "final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref_losses, losses = (json.loads((d / "losses.json").read_text()) for d in (reference, run))
    assert losses and all(ref_losses[k] == v for k, v in losses.items())
    left = [n for n in os.listdir(run / "vidstab" / "checkpoints") if n.startswith(".tmp-")]
    assert not left
    for d in (run / "vidstab" / "checkpoints").iterdir():
        if d.is_dir():
            assert not [f for f in os.listdir(d) if f.endswith((".pt", ".bin", ".pkl", ".pickle"))]


def _start_step(r):
    line = next(li for li in r.stdout.splitlines() if li.startswith("start step"))
    return int(line.split()[-1])


def test_sigkill_at_each_phase_of_a_save_resumes_to_identical_weights(tmp_path, reference):
    run = tmp_path / "run"
    last = 0
    # tensors: files half done, no manifest; manifest: a torn manifest.json; pointer: renamed but `latest`
    # (or `last_good`) not replaced yet; rotate: complete, old ones not deleted yet.
    for kill, mode in (("tensors:5", []), ("manifest:2", ["--async"]), ("pointer:3", []), ("rotate:2", ["--async"])):
        r = _run(run, "--kill-at", kill, *mode, check=False)
        assert r.returncode == -signal.SIGKILL, f"{kill}: {r.returncode} {r.stderr[-2000:]}"
        start = _start_step(r)
        assert start >= last, f"resume went back from {last} to {start}"
        last = start
        # The interrupted save never shows up as a checkpoint.
        assert all((d / "manifest.json").exists() for d in (run / "vidstab" / "checkpoints").glob("step_*"))
    r = _run(run)
    assert _start_step(r) >= last > 0
    _assert_same_as_reference(run, reference)


def test_random_sigkills_with_the_chaos_script(tmp_path, reference):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos_checkpoint.py"), "--kills", "1", *ARGS,
                        "--reference", str(reference.folder()), "--workdir", str(tmp_path), "--seed", "1"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and res["ok"], r.stdout + r.stderr
    assert res["kills"] == 1 and res["runs_finished"] >= 1


def test_sigterm_preemption_saves_exits_0_and_resumes(tmp_path, reference):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, TRAIN, "--out", str(run), *ARGS, "--preempt", "--save-every", "100",
                          "--step-sleep", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    for line in p.stdout:
        if line.startswith("step 2 "):
            p.send_signal(signal.SIGTERM)
            break
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    stopped = int(next(li for li in out.splitlines() if li.startswith("preempted at step")).split()[-1])
    assert 2 <= stopped < 12
    assert (run / "vidstab" / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:06d}"
    r = _run(run)
    assert _start_step(r) == stopped
    _assert_same_as_reference(run, reference)
