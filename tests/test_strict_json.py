"""vidstab.strict_json's one convention, through the writers that use it: non-finite -> "nan"/"inf"/"-inf"."""

from __future__ import annotations

import json
import math

from vidstab.atomic import fsync_paths, write_json_atomic
from vidstab.events import EventLog
from vidstab.strict_json import from_json_safe, json_float


def _refuse(token):
    raise ValueError(f"non-standard JSON token {token}")


def test_state_files_and_event_lines_spell_non_finite_numbers_alike(tmp_path):
    value = {"nan": math.nan, "inf": math.inf, "neg": -math.inf, "none": None, "x": 1.5, "pair": (1, math.nan)}
    path = write_json_atomic(tmp_path / "state.json", value)
    fsync_paths([path, tmp_path])  # files and folders alike
    from_file = json.loads(path.read_text(), parse_constant=_refuse)
    log = EventLog(tmp_path, rank=0)
    log.log("metrics", 0, **value)
    log.close()
    line = json.loads((tmp_path / "vidstab" / "events-rank0.jsonl").read_text(), parse_constant=_refuse)
    expected = {"nan": "nan", "inf": "inf", "neg": "-inf", "none": None, "x": 1.5, "pair": [1, "nan"]}
    assert from_file == expected and {k: line[k] for k in expected} == expected
    assert math.isnan(json_float(line["nan"])) and json_float(line["neg"]) == -math.inf and json_float(None) is None
    back = from_json_safe(from_file)
    assert math.isnan(back["nan"]) and back["inf"] == math.inf and back["x"] == 1.5 and back["none"] is None
