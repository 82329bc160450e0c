"""``python -m vidstab``: the same as the ``vidstab`` command (see :mod:`vidstab.cli`)."""

import sys

from vidstab.cli import main

sys.exit(main())
