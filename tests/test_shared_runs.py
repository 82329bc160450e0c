"""The suite's shared runs are built once however pytest-xdist spreads their readers, and two launches never
get the same rendezvous port: real processes racing for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent

RACER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from trainer_utils import free_port, shared_run

    def build(folder):
        folder.mkdir(parents=True)
        with open(Path({root!r}) / "builds", "a") as fh:
            fh.write(f"{{os.getpid()}}\\n")
        time.sleep(1.0)  # long enough for every racer to be waiting
        (folder / "result").write_text("built")

    ports = [free_port() for _ in range(20)]
    path = shared_run(Path({root!r}), "the-run", build)
    print(json.dumps({{"path": str(path), "result": (path / "result").read_text(), "ports": ports}}), flush=True)
    sys.stdin.read()  # keep the port reservations until every racer has reported
""")


def test_a_shared_run_is_built_once_by_racing_workers_and_their_ports_never_collide(tmp_path):
    code = RACER.format(tests=str(TESTS), root=str(tmp_path))
    racers = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
              for _ in range(4)]
    try:
        reports = [json.loads(p.stdout.readline()) for p in racers]
    finally:
        for p in racers:
            p.stdin.close()
            p.wait(timeout=60)
    assert len((tmp_path / "builds").read_text().split()) == 1  # one build for four readers
    assert {r["path"] for r in reports} == {str(tmp_path / "shared-runs" / "the-run")}
    assert all(r["result"] == "built" for r in reports)
    ports = [port for r in reports for port in r["ports"]]
    assert len(ports) == len(set(ports)) == 80, "two launches were given the same port"
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()) \
        if os.path.exists("/proc/sys/net/ipv4/ip_local_port_range") else (32768, 60999)
    assert not [p for p in ports if low <= p <= high], "a rendezvous port inside the ephemeral range"


def test_a_failed_shared_build_fails_the_other_readers_with_its_error_instead_of_rebuilding(tmp_path):
    from trainer_utils import shared_run

    calls = []

    def failing(folder):
        calls.append(folder)
        raise AssertionError("trainer exited 1")

    for _ in range(2):
        try:
            shared_run(tmp_path, "broken", failing)
        except AssertionError as e:
            assert "trainer exited 1" in str(e)
        else:
            raise AssertionError("a failed build passed")
    assert len(calls) == 1
