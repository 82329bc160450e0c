"""The docs point at files a reader can open: every repository path they cite in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/install.md", "docs/troubleshooting.md", "docs/ARCHITECTURE.md", "docs/PRACTICES.md", "docs/deepspeed.md",
        "benchmarks/RESULTS.md"]
# Source folders of this repository. ``vidstab/...`` paths count only as source files (``.py`` or a
# package folder): ``vidstab/recovery.json`` and ``vidstab/checkpoints/`` are paths inside a run folder.
CITED = re.compile(r"`((?:tests|benchmarks|recipes|examples|scripts|docs)/[\w/.*\-]+|vidstab/[\w/\-]+(?:\.py)?)[`:( ]")


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_repository_path_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = []
    for cited in sorted(set(CITED.findall(text))):
        path = cited.rstrip("./")
        if path.startswith("benchmarks/.cache"):  # recordings the benchmarks write (git-ignored): absent on a fresh clone
            continue
        if not (list(ROOT.glob(path)) or list(ROOT.glob(path + "*")) or (ROOT / path).exists()):
            missing.append(cited)
    assert not missing, f"{doc} cites paths that do not exist: {missing}"
