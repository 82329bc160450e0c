"""Small HTML pieces shared by the sections, and the page's stylesheet (no external assets)."""

from __future__ import annotations

import html
import os
from pathlib import Path
from urllib.parse import quote


def _nodata(why: str) -> str:
    return f'<p class="nodata">no data: {html.escape(why)}</p>'


def _short_list(items: list, n: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:n])
    return shown + (f", ... (+{len(items) - n})" if len(items) > n else "")


def _run_file_href(run_dir: Path, name: object, out_dir: Path) -> str | None:
    """A link to the file ``name`` of the run folder, relative to the page in ``out_dir``, or None when
    ``name`` is not a plain relative path inside the run folder (a URL, ``javascript:``, an absolute path,
    ``..``): event logs travel, so a name in them never becomes a link elsewhere. Every path component is
    percent-encoded, so nothing in it reads as a URL scheme, query or fragment."""
    if not isinstance(name, str) or not name or "\\" in name or name.startswith("/") or any(ord(c) < 32 for c in name):
        return None
    parts = Path(name).parts
    if ".." in parts or any(":" in p for p in parts):
        return None
    target = os.path.relpath(run_dir / name, out_dir)
    return "/".join(quote(p, safe="") for p in Path(target).parts)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
h1{font-size:1.5em;margin-bottom:0.2em} h2{font-size:1.15em;border-bottom:1px solid #ddd;padding-bottom:2px;margin-top:1.6em}
.verdict{font-size:1.15em;font-weight:600;padding:0.5em 0.8em;border-radius:4px}
.good{background:#e6f4ea;color:#1e6b34}.neutral{background:#eef0f3;color:#333}.warn{background:#fff4e0;color:#8a5300}.bad{background:#fde7e7;color:#a11}
table{border-collapse:collapse;font-size:0.85em} td,th{padding:3px 8px;text-align:left;vertical-align:top}
table.grid td,table.grid th{border:1px solid #ddd} table.kv th{font-weight:500;color:#555}
tr.k-skip td,tr.k-rollback td{background:#fff6f6} tr.k-warn td{background:#fffbea} tr.flag td{background:#fff0f0;font-weight:600}
.mono{font-family:ui-monospace,Menlo,monospace;font-size:0.9em;word-break:break-all}
.nodata{color:#888;font-style:italic} .caption{color:#555;font-size:0.85em;margin-top:0}
img{max-width:100%} nav a{margin-right:0.8em;font-size:0.85em}
"""
