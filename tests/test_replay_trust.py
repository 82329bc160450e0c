"""Replay never runs a stranger's code: malicious bundles are refused before anything is imported or run.

Each bundle below would create a marker file if any of its code ran; the tests assert that replay refuses
it (exit code 2, a message naming what the bundle names and how to allow it) and that no file appears.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))

from replay_user_model import make_batch  # noqa: E402

from vidstab.evidence.capture import write_incident  # noqa: E402
from vidstab.tools.replay import UntrustedCodeError, main, replay  # noqa: E402
from vidstab.tools.trusted_import import UntrustedImportError, resolve  # noqa: E402

FINDING = {"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN", "figures": {"grad_norm": float("nan")}}
USER_MODEL = {"factory": "replay_user_model:make_model", "kwargs": {"channels": 4, "hidden": 16}}
EVIL_MODULE = textwrap.dedent("""
    from pathlib import Path
    Path({marker!r}).write_text("evilmod was imported")

    def build(**kwargs):
        Path({marker!r}).write_text("evilmod.build ran")

    def loss(model, batch):
        Path({marker!r}).write_text("evilmod.loss ran")
""")


def bundle(run_dir: Path, spec: dict) -> Path:
    return write_incident(run_dir, step=3, micro_step=0, rank=0, world_size=1, batch=make_batch(),
                          sample_ids=["a", "b", "c"], finding=FINDING, lr=1e-3, precision="no", seed=0,
                          checkpoint=None, model_spec=spec)


def replay_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m vidstab replay ...``: ``-m`` itself puts ``cwd`` first on ``sys.path``, so a module
    beside the bundle is importable there; only the trust check keeps it from being imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    return subprocess.run([sys.executable, "-m", "vidstab", "replay", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_os_system_factory_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    b = bundle(tmp_path / "run", {"factory": "os:system", "kwargs": {"command": f"touch {marker}"},
                                  "loss_fn": "replay_user_model:video_mse"})
    assert main([str(b)]) == 2
    err = capsys.readouterr().err
    assert "model.factory names os:system" in err and "--trust os" in err
    assert not marker.exists()
    with pytest.raises(UntrustedCodeError):
        replay(b)
    assert not marker.exists()


def test_module_beside_the_bundle_is_never_imported(tmp_path):
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    b = bundle(run, {"factory": "evilmod:build", "kwargs": {}, "loss_fn": "evilmod:loss"})
    for folder in (b, run):  # beside the bundle, and in the folder replay is run from
        (folder / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    for cwd, target in ((b, b), (run, run)):  # `vidstab replay RUN_DIR` picks the bundle by itself
        proc = replay_cli(str(target), cwd=cwd)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "evilmod:build" in proc.stderr and "--trust evilmod" in proc.stderr
        assert not marker.exists()
    assert "evilmod" not in sys.modules


def test_malicious_loss_function_is_refused_before_it_is_imported(tmp_path, capsys):
    marker = tmp_path / "pwned"
    (tmp_path / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    sys.path.insert(0, str(tmp_path))  # even importable, it is not trusted
    try:
        for loss in ("evilmod:loss", "os:system", "builtins:exec"):
            b = bundle(tmp_path / loss.replace(":", "_"), dict(USER_MODEL, loss_fn=loss))
            assert main([str(b), "--trust", "replay_user_model"]) == 2
            err = capsys.readouterr().err
            assert f"loss.fn names {loss}" in err and f"--trust {loss.split(':')[0]}" in err
    finally:
        sys.path.remove(str(tmp_path))
    assert not marker.exists() and "evilmod" not in sys.modules


def test_a_vidstab_function_that_writes_files_is_not_a_model_factory(tmp_path, capsys):
    target = tmp_path / "written-by-bundle"
    b = bundle(tmp_path / "run", {"factory": "vidstab.files.atomic:write_atomic",
                                  "kwargs": {"path": str(target), "data": "x"}, "loss_fn": "replay_user_model:video_mse"})
    assert main([str(b)]) == 2
    assert "vidstab.files.atomic:write_atomic" in capsys.readouterr().err
    assert not target.exists()
    # ... nor a class spec naming a function
    with pytest.raises(UntrustedImportError, match="defines no class 'write_atomic'"):
        resolve("vidstab.files.atomic:write_atomic", "model.class", kind="model_class")
    # ... and a class the module only imports (a re-export) is checked after the import
    with pytest.raises(UntrustedImportError, match="not a torch.nn.Module class"):
        resolve("vidstab.evidence.capture:Path", "model.class", kind="model_class")


def test_trusted_names_resolve_old_bundle_paths_included(tmp_path):
    # Paths recorded in existing bundles keep resolving without any flag.
    from vidstab.reference.model import VideoDiT
    from vidstab.reference.objective import replay_loss

    assert resolve("vidstab.reference.model:VideoDiT", "model.class", kind="model_class") is VideoDiT
    assert resolve("vidstab.reference.objective:replay_loss", "loss.fn") is replay_loss
    import diffusers

    assert resolve("diffusers:UNet2DModel", "model.class", kind="model_class") is diffusers.UNet2DModel
    with pytest.raises(UntrustedImportError):
        resolve("replay_user_model:make_model", "model.factory")
    # What the user allows explicitly: a module (and its submodules) or one object.
    import replay_user_model

    assert resolve("replay_user_model:make_model", "model.factory", trust=["replay_user_model"]) \
        is replay_user_model.make_model
    assert resolve("replay_user_model:make_model", "model.factory", trust=["replay_user_model:make_model"]) \
        is replay_user_model.make_model
    with pytest.raises(UntrustedImportError):
        resolve("replay_user_model:video_mse", "loss.fn", trust=["replay_user_model:make_model"])


def test_trusted_user_bundle_replays(tmp_path, capsys):
    batch = make_batch()
    batch["latents"][1] = float("nan")
    b = write_incident(tmp_path, step=3, micro_step=0, rank=0, world_size=1, batch=batch, sample_ids=["a", "b", "c"],
                       finding=FINDING, lr=1e-3, precision="no", seed=0, checkpoint=None,
                       model_spec=dict(USER_MODEL, loss_fn="replay_user_model:video_mse"))
    assert main([str(b)]) == 2
    assert "--trust replay_user_model" in capsys.readouterr().err
    assert main([str(b), "--trust", "replay_user_model"]) == 0
    assert "Verdict: Reproduces" in capsys.readouterr().out
