"""A newcomer's install: the distribution name is not PyPI's unrelated ``vidstab``, an import of that package is
named as such, the documented CPU install is the one the docs give, and ``vidstab --help`` does not import torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

# What PyPI's vidstab 1.7.4 (OpenCV video stabilisation) installs as vidstab/__init__.py, with its VidStab.py.
OTHER_INIT = textwrap.dedent("""
    from .VidStab import VidStab
    from .download_videos import download_ostrich_video
    from .layer_utils import layer_blend, layer_overlay
    from .version import __version__
""")


def _python(*args: str, pythonpath: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_the_distribution_is_not_named_like_pypis_other_vidstab_and_the_docs_install_it():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "vidstab-train"
    assert all(not d.startswith("vidstab[") for d in project["optional-dependencies"]["test"])
    readme, install = (REPO / "README.md").read_text(), (REPO / "docs" / "install.md").read_text()
    assert "pip install vidstab\n" not in readme and "`pip install vidstab`" not in readme
    assert "**Not `pip install vidstab`.**" in install and "pip uninstall -y vidstab" in install
    # A CPU-only user gets the CPU build; CI keeps its own install (the README's test command is .ci/run's).
    ci = (REPO / ".ci" / "run").read_text()
    pin = next(w for w in ci.split() if w.startswith("torch=="))
    assert f"pip install {pin} {CPU_INDEX}" in readme.split("## The two commands")[0]
    assert f"pip install {pin} {CPU_INDEX}" in install
    assert f"pip install {pin} " in ci and "download.pytorch.org" not in ci


def test_vidstab_help_answers_without_importing_torch():
    probe = textwrap.dedent("""
        import sys
        sys.argv = ["vidstab", "--help"]
        from vidstab.tools.cli import main   # what the console script runs
        try:
            main()
        except SystemExit:
            pass
        heavy = sorted(m for m in ("torch", "numpy", "matplotlib", "diffusers", "accelerate") if m in sys.modules)
        print("HEAVY", heavy)
    """)
    done = _python("-c", probe, pythonpath=str(REPO))
    assert done.returncode == 0, done.stderr
    assert "usage: vidstab" in done.stdout and "HEAVY []" in done.stdout, done.stdout
    done = _python("-c", "import sys, runpy; sys.argv = ['vidstab', '--help']\ntry:\n    runpy.run_module('vidstab', "
                   "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)", pythonpath=str(REPO))
    assert done.stdout.strip().endswith("False"), done.stdout + done.stderr  # python -m vidstab --help
    # ... and the package still gives its whole API on use.
    done = _python("-c", "import vidstab; print(vidstab.attach.__name__, vidstab.GuardConfig.__name__, "
                   "vidstab.faults.__name__)", pythonpath=str(REPO))
    assert done.stdout.split() == ["attach", "GuardConfig", "vidstab.faults"], done.stderr


def test_the_trainer_names_pypis_other_vidstab_instead_of_failing_on_it(tmp_path):
    other = tmp_path / "site" / "vidstab"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text(OTHER_INIT)
    (other / "VidStab.py").write_text("import cv2\n\nclass VidStab:\n    pass\n")
    done = _python(str(REPO / "recipes" / "train.py"), "--help", pythonpath=str(tmp_path / "site"), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PyPI's 'vidstab', an unrelated OpenCV video-stabilisation package" in done.stderr, done.stderr
    assert "pip uninstall -y vidstab" in done.stderr and "Traceback" not in done.stderr


def test_both_installed_into_one_folder_is_said_at_import(tmp_path):
    merged = tmp_path / "site" / "vidstab"
    shutil.copytree(REPO / "vidstab", merged, ignore=shutil.ignore_patterns("__pycache__"))
    (merged / "VidStab.py").write_text("class VidStab:\n    pass\n")
    done = _python("-W", "always", "-c", "import vidstab", pythonpath=str(tmp_path / "site"), cwd=tmp_path)
    assert "also holds files of PyPI's 'vidstab'" in done.stderr, done.stderr
    (merged / "__init__.py").write_text(OTHER_INIT)  # the other package installed last: its __init__ won
    done = _python(str(REPO / "recipes" / "train.py"), "--help", pythonpath=str(tmp_path / "site"), cwd=tmp_path)
    assert done.returncode == 1 and "is PyPI's 'vidstab'" in done.stderr and "Traceback" not in done.stderr, done.stderr
