"""``python -m vidstab``: the same as the ``vidstab`` command (see :mod:`vidstab.tools.cli`)."""

import sys

from vidstab.tools.cli import main

sys.exit(main())
