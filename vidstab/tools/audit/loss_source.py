"""4. Loss source: a heuristic scan for log/div/sqrt with no epsilon on the same line."""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize
from typing import Any

import torch

from .findings import finding

# (pattern, what it does at the edge). Stable variants (log1p, log_softmax, logsumexp) do not match.
_RISKY_OPS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"(?<![\w.])(?:\w+\.)*log(?:2|10)?\s*\(|\.log(?:2|10)?_?\s*\("), "log(x) is -inf when x reaches zero (NaN below)"),
    (re.compile(r"\brsqrt\s*\(|\.rsqrt_?\s*\("), "rsqrt(x) is inf when x reaches zero"),
    (re.compile(r"(?<!r)\bsqrt\s*\(|\.sqrt_?\s*\("), "sqrt(x) has an infinite gradient when x reaches zero"),
    (re.compile(r"\breciprocal_?\s*\("), "1/x is inf when x reaches zero"),
    (re.compile(r"\bpow\s*\([^)]*,\s*-|\*\*\s*\(?\s*-"), "a negative power is inf when its base reaches zero"),
    # Division by anything but a number literal or a count (len, numel, shape, size).
    (re.compile(r"(?<![/*])/(?![/=])\s*(?!\s*[\d.]+(?:e-?\d+)?\b)(?!\s*(?:len\(|\w+\.numel\(|\w+\.shape|\w+\.size\(|math\.))"),
     "a division is inf when its divisor reaches zero"),
]

_EPSILON = re.compile(r"eps|epsilon|1e-\d|clamp|clip|nan_to_num|maximum|finfo|tiny", re.IGNORECASE)


def _code_only(source: str) -> str:
    """Source with comments and string literals blanked (same line numbers), so docstrings do not match."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError):
        return source
    lines = source.splitlines(keepends=True)
    blank = [list(line) for line in lines]
    for tok in tokens:
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = blank[r - 1]
                start = c0 if r == r0 else 0
                end = c1 if r == r1 else len(row)
                for c in range(start, min(end, len(row))):
                    if row[c] != "\n":
                        row[c] = " "
    out = ["".join(row) for row in blank]
    return "".join(out)


def audit_loss_source(fn_or_module: Any) -> list[dict]:
    """Scan a loss function's (or module's / class's) source for operations that reach inf at zero.

    ``log(``, ``/``, ``sqrt(``, ``rsqrt(``, ``reciprocal(`` and negative powers on a line with no epsilon,
    clamp or similar on the same line give a ``loss.source`` warning naming the
    line. A heuristic: it reads text, not values, so it can warn about a divisor that is never zero.
    """
    target = fn_or_module
    if isinstance(target, torch.nn.Module):
        target = type(target)
    label = getattr(target, "__qualname__", None) or repr(target)
    try:
        source = textwrap.dedent(inspect.getsource(target))
        _, first_line = inspect.getsourcelines(target)
        file = inspect.getsourcefile(target) or "?"
    except (OSError, TypeError):
        return [finding("loss.source", "info", f"source of {label} is not available; loss scan skipped")]
    code_lines = _code_only(source).splitlines()
    findings = []
    for i, line in enumerate(code_lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("def ", "class ", "@", "import ", "from ")):
            continue
        if _EPSILON.search(line):
            continue
        for pattern, why in _RISKY_OPS:
            if pattern.search(line):
                lineno = first_line + i
                findings.append(finding(
                    "loss.source", "warn",
                    f"{label} line {lineno}: `{stripped[:80]}`: {why}; add an epsilon (or clamp) "
                    "(heuristic source scan)",
                    file=file, line=lineno, code=stripped,
                ))
                break
    if not findings:
        findings.append(finding("loss.source", "info", f"{label}: no unguarded log/div/sqrt found (heuristic source scan)"))
    return findings
