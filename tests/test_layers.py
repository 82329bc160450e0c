"""The layers of docs/ARCHITECTURE.md hold: the core plugin imports neither the tools, nor the reference
trainer's package, nor anything only they need (so `pip install -e .` without extras runs the guard)."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import vidstab

REPO = Path(__file__).parent.parent
#: Packages only the tools or the reference trainer need (pyproject's extras), and our own upper layers.
BLOCKED = ("vidstab.reference", "vidstab.tools", "diffusers", "einops", "datasets", "av", "matplotlib",
           "tensorboard", "deepspeed", "transformers")


def core_modules() -> list[str]:
    """Every module of the core plugin: vidstab's own modules and subpackages except tools and reference."""
    names = ["vidstab"]
    for info in pkgutil.walk_packages(vidstab.__path__, "vidstab."):
        if not info.name.startswith(("vidstab.tools", "vidstab.reference")) and info.name != "vidstab.__main__":
            names.append(info.name)
    return names


def test_core_modules_import_without_the_tools_the_reference_or_their_dependencies():
    modules = core_modules()
    assert {"vidstab.guard", "vidstab.checkpoint", "vidstab.recovery.policy", "vidstab.detectors.grad_spike"} <= set(modules)
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        BLOCKED = {BLOCKED!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ImportError(f"layering: a core module imported {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        for name in {modules!r}:
            importlib.import_module(name)
        # The public API resolves its lazy names without them too.
        import vidstab
        for name in vidstab._LAZY:
            getattr(vidstab, name)
        leaked = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
        assert not leaked, leaked
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_tools_never_put_the_current_or_bundle_folder_on_sys_path():
    # Static guard for the trust boundary of vidstab.tools.trusted_import: no tool edits sys.path.
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "vidstab").rglob("*.py")
                 if "sys.path.insert" in p.read_text() or "sys.path.append" in p.read_text()]
    assert offenders == []


def test_reference_package_without_its_extra_names_the_extra():
    # ``sys.modules[name] = None`` is how Python marks a package as not importable: as if it were not installed.
    script = textwrap.dedent("""
        import sys
        sys.modules["einops"] = None
        try:
            import vidstab.reference
        except ImportError as exc:
            print(exc)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "needs the [reference] extra" in proc.stdout and "missing: einops" in proc.stdout, proc.stdout + proc.stderr
    assert 'pip install -e ".[reference]" in your vidstab clone' in proc.stdout


def test_only_the_engines_tell_the_training_engines_apart():
    # Static guard for vidstab/engines: every DDP / FSDP2 / DeepSpeed difference is asked of the run's Engine.
    tells = ("is_deepspeed(", 'endswith("FSDP")', "fsdp_plugin", "deepspeed_plugin")
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "vidstab").rglob("*.py")
                 if not p.relative_to(REPO).as_posix().startswith("vidstab/engines/")
                 and any(t in p.read_text() for t in tells)]
    assert offenders == []
