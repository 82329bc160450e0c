"""Is the ``vidstab`` that Python imports this project? PyPI's ``vidstab`` is an unrelated OpenCV video
stabilisation package with the same import name; this project is distributed as ``vidstab-train``.

This module imports nothing of vidstab's (it is loaded by file path by ``recipes/train.py`` before
``import vidstab``, when the ``vidstab`` on the path may be the other package) and runs nothing it inspects:
it reads the source of the ``vidstab/__init__.py`` Python would import.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

__all__ = ["DISTRIBUTION", "OTHER_PACKAGE_FILE", "wrong_vidstab", "check_same_folder"]

DISTRIBUTION = "vidstab-train"
"""This project's distribution name: ``pip install -e .`` in a clone installs it."""
OTHER_PACKAGE_FILE = "VidStab.py"
"""A file only PyPI's OpenCV ``vidstab`` has (its ``VidStab`` class)."""
FIX = ("pip uninstall -y vidstab vidstab-train, then install this project from its clone: pip install -e '.[reference,report]' "
       "(docs/install.md)")


def wrong_vidstab() -> str | None:
    """A message saying what is wrong when ``import vidstab`` would not give this project, else None."""
    try:
        spec = importlib.util.find_spec("vidstab")
    except (ImportError, ValueError) as err:
        return f"cannot find the vidstab module ({err}); install {DISTRIBUTION}: {FIX}"
    if spec is None or not spec.origin:
        return f"no module named 'vidstab' is installed; install {DISTRIBUTION}: {FIX}"
    folder = os.path.dirname(spec.origin)
    try:
        with open(spec.origin, encoding="utf-8", errors="replace") as fh:
            ours = "DISTRIBUTION as __distribution__" in fh.read()
    except OSError:
        ours = False
    if ours:
        return None
    what = ("PyPI's 'vidstab', an unrelated OpenCV video-stabilisation package with the same import name"
            if os.path.exists(os.path.join(folder, OTHER_PACKAGE_FILE)) else "another package than vidstab-train")
    return f"the 'vidstab' module Python imports ({folder}) is {what}, not this project ({DISTRIBUTION}). Fix: {FIX}"


def check_same_folder() -> None:
    """Warn when PyPI's OpenCV ``vidstab`` was installed into this package's folder too (both distributions
    write ``site-packages/vidstab/``, so whichever was installed last owns ``__init__.py``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, OTHER_PACKAGE_FILE)):
        warnings.warn(f"{here} also holds files of PyPI's 'vidstab' (OpenCV video stabilisation, {OTHER_PACKAGE_FILE}), "
                      f"installed over this project ({DISTRIBUTION}); either may break the other. Fix: {FIX}",
                      stacklevel=3)
