"""vidstab.files.strict_json's one convention, through the writers that use it: non-finite -> "nan"/"inf"/"-inf"."""

from __future__ import annotations

import json
import math

from vidstab.files.atomic import fsync_paths, write_json_atomic
from vidstab.events import EventLog
from vidstab.files.strict_json import from_json_safe, json_float


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


def test_metrics_lines_read_back_as_logged_whichever_encoder_writes_them(tmp_path):
    """Healthy metrics lines are encoded by orjson (vidstab/events.py, EventLog._metrics_line); lines it would
    spell differently (non-finite values) or refuse (numpy scalars, integers past 64 bits) take the json path."""
    import numpy as np

    plain = {"loss": 0.512017250061035, "lr": 1e-05, "big": 1e22, "tiny": 5e-324, "neg_zero": -0.0, "count": 7,
             "huge_int": 2**63 - 1, "applied": True, "param_norm": None, "verdict": "OK", "name": "é",
             "loss_by_t": [None, 0.25, None]}
    odd = {"np32": np.float32(0.5), "np64": np.float64(2.5), "past_64_bits": 2**70, "by_t": [1.0, math.inf]}
    log = EventLog(tmp_path, rank=0)
    log.log_metrics(1, dict(plain))
    log.log_metrics(2, dict(odd))
    log.log_metrics(3, {"loss": 0.5, "past_64_bits": 2**70})  # plain, but past what orjson writes
    log.close()
    lines = (tmp_path / "vidstab" / "events-rank0.jsonl").read_text(encoding="utf-8").splitlines()
    first, second, third = (json.loads(line, parse_constant=_refuse) for line in lines)
    assert third["past_64_bits"] == 2**70 and third["loss"] == 0.5
    assert {k: first[k] for k in plain} == plain and first["kind"] == "metrics" and first["step"] == 1
    assert second["np32"] == 0.5 and second["np64"] == 2.5 and second["past_64_bits"] == 2**70
    assert second["by_t"] == [1.0, "inf"]
