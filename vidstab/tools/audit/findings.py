"""Findings (plain dicts with a severity) and the report that collects them: table, JSON, exit status."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...files.strict_json import dumps_strict

SEVERITIES = ("info", "warn", "block")

# How many ids a finding's message names before it says "and N more".
_IDS_IN_MESSAGE = 8


def finding(check: str, severity: str, message: str, **details: Any) -> dict:
    """One finding: ``{"check", "severity", "message", "details"}`` (details must be JSON-serialisable)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    return {"check": check, "severity": severity, "message": message, "details": details}


def _name_ids(ids: list[str]) -> str:
    """``a, b, c`` or ``a, b, ... (+12 more)``: ids short enough for a one-line message."""
    shown = ", ".join(ids[:_IDS_IN_MESSAGE])
    return shown + (f" (+{len(ids) - _IDS_IN_MESSAGE} more)" if len(ids) > _IDS_IN_MESSAGE else "")


@dataclass


class AuditReport:
    """The findings of one audit, with the blocking ones singled out."""

    findings: list[dict] = field(default_factory=list)
    """Every finding, in the order the checks ran."""

    @property
    def blocking(self) -> list[dict]:
        """Findings with severity ``"block"``: training should not start while any exist."""
        return [f for f in self.findings if f["severity"] == "block"]

    @property
    def warnings(self) -> list[dict]:
        """Findings with severity ``"warn"``."""
        return [f for f in self.findings if f["severity"] == "warn"]

    @property
    def unreadable(self) -> list[dict]:
        """``*.read`` findings: an input (latent cache, config file) could not be read at all. The command
        line exits 2 (unreadable input) for these rather than 1 (findings that block)."""
        return [f for f in self.findings if f["check"].endswith(".read")]

    @property
    def ok(self) -> bool:
        """True when nothing blocks."""
        return not self.blocking

    def extend(self, findings: Iterable[dict]) -> None:
        """Add findings (from one of the ``audit_*`` functions)."""
        self.findings.extend(findings)

    def to_dict(self) -> dict:
        """``{"schema", "ok", "counts": {severity: n}, "findings": [...]}``."""
        counts = {s: sum(f["severity"] == s for f in self.findings) for s in SEVERITIES}
        return {"schema": 1, "ok": self.ok, "counts": counts, "findings": self.findings}

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        """The report as JSON; also written to ``path`` when given."""
        text = dumps_strict(self.to_dict(), indent=indent)  # non-finite numbers as "nan"/"inf" strings
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def format_table(self, width: int = 100) -> str:
        """A plain-text table, worst first, for a terminal: severity, check, message (wrapped)."""
        order = {"block": 0, "warn": 1, "info": 2}
        rows = sorted(self.findings, key=lambda f: order[f["severity"]])
        check_w = max([len("check")] + [len(f["check"]) for f in rows])
        msg_w = max(30, width - 8 - check_w - 4)
        lines = [f"{'SEVERITY':<8}  {'check':<{check_w}}  message", "-" * min(width, 8 + 2 + check_w + 2 + msg_w)]
        for f in rows:
            wrapped = textwrap.wrap(f["message"], msg_w) or [""]
            lines.append(f"{f['severity'].upper():<8}  {f['check']:<{check_w}}  {wrapped[0]}")
            lines.extend(f"{'':<8}  {'':<{check_w}}  {more}" for more in wrapped[1:])
        counts = self.to_dict()["counts"]
        verdict = "BLOCKED: fix the blocking findings before training" if self.blocking else "OK to train"
        lines.append("")
        lines.append(f"{counts['block']} blocking, {counts['warn']} warnings, {counts['info']} info -> {verdict}")
        return "\n".join(lines)
