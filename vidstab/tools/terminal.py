"""Text from a run folder made safe to print: names and sample ids come from files a stranger may have written."""

from __future__ import annotations

from typing import Any

__all__ = ["printable"]


def printable(text: Any) -> str:
    """``str(text)`` with every character a terminal would act on (escape sequences, other control and
    format characters, newlines) written as its Python escape (``\\x1b``), so printing it cannot retitle,
    clear or recolour the terminal nor forge lines of output."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)
