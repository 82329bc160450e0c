"""Compatibility entry point: installs made before the tools moved to :mod:`vidstab.tools` have a ``vidstab``
console script that calls ``vidstab.cli:main``. The command lives in :mod:`vidstab.tools.cli`; this module
imports it only when called, so the core package still never imports the tools."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the ``vidstab`` command (:func:`vidstab.tools.cli.main`)."""
    from .tools.cli import main as tools_main

    return tools_main(argv)
