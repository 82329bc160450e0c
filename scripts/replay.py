#!/usr/bin/env python
"""Replay an incident bundle: ``python scripts/replay.py BUNDLE [--trust MODULE] [--device cpu] [--json PATH]``.

A thin wrapper over :func:`vidstab.tools.replay.main` (the same as ``vidstab replay``); see that module for
what the replay checks and which code it imports (vidstab's own, and what ``--trust`` names). Exit code 0
when a report was produced, 2 when the bundle cannot be replayed or names code that is not trusted.
"""

import sys

from vidstab.tools.replay import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
