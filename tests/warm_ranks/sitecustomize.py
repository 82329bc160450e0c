"""Put on ``PYTHONPATH`` by tests/conftest.py: in a launcher the tests start (``accelerate launch``, ``torchrun``),
the script's processes are forks of the launcher instead of fresh interpreters (:mod:`warm_rank_fork`). Every other
process only registers a finder that waits for a launcher's modules."""

import os
import sys

if os.environ.get("VIDSTAB_TEST_WARM_RANKS") == "1":
    try:
        import warm_rank_fork

        warm_rank_fork.install()
    except Exception as exc:  # a test helper must never change what a process does when it cannot load
        print(f"tests/warm_ranks: not loaded ({exc!r})", file=sys.stderr)
