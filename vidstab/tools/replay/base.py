"""Replay's limits, exit codes and error type, shared by every stage."""

from __future__ import annotations

import math

ABSMAX_LIMIT = 50.0
"""Per-sample absmax above which a (normalised) input is called out of range."""

SPIKE_TOLERANCE = 0.10
"""A spike reproduces when the replayed gradient norm is within this fraction of the recorded one."""

JUMP_FACTOR = 2.0
"""After one update, a loss more than this many times the loss before counts as a jump."""

LOO_INFLUENCE = 0.5
"""For a finite spike: a sample whose removal brings the gradient norm below this fraction of the full
batch's is named as driving it."""

REPORT_FILE = "replay_report.json"

EXIT_OK = 0

EXIT_CANNOT_REPLAY = 2


class ReplayError(RuntimeError):
    """The bundle cannot be replayed; the message says what is missing and how to fix it."""


class UntrustedCodeError(ReplayError):
    """The bundle names code the user has not trusted; nothing was imported or run."""


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else math.inf
