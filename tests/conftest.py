import json
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.environ.get("VIDSTAB_TEST_COLD_START"):
    # the ranks of the tests' `accelerate launch` / torchrun are forked from their launcher (tests/warm_ranks)
    os.environ["VIDSTAB_TEST_WARM_RANKS"] = "1"
    warm_ranks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_ranks")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (warm_ranks, os.environ.get("PYTHONPATH")) if p)


SAME_RUN_AS = {"nan_batch_rank1_run": "conformance-reference-ddp"}
"""Session fixtures that are a conformance row's launch: their readers join that row's group (tests/test_conformance.py)."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks (xdist/remote.py)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup` (.ci/run), keep the tests that share a module- or session-scoped
    fixture (one real training run read by several tests) on one worker: tests are joined when they share any
    such fixture, also through a third test (a test using two shared fixtures joins both groups), and each
    joined set is one xdist_group. The shared runs themselves are also built once per session whatever the
    schedule (`trainer_utils.shared_run`: a lock and a cache folder all workers see), so grouping only saves
    the waiting. Reads pytest's fixture resolution of each test (`_fixtureinfo`, not public API): if a pytest
    release moves it, nothing is grouped, still correct."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    shared_by_item = []
    for item in items:
        defs_by_name = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None) or {}
        shared = []
        for name in getattr(item, "fixturenames", ()):
            defs = defs_by_name.get(name)
            scope, where = (getattr(defs[-1], "scope", None), getattr(defs[-1], "baseid", "")) if defs else (None, "")
            if scope not in ("session", "module") or not where:
                continue  # pytest's own (tmp_path_factory, ...) are defined with an empty baseid
            # two modules may each define a module fixture of one name: they are different runs
            shared.append(name if scope == "session" else f"{item.path.name}::{name}")
        for key in shared:
            parent[find(key)] = find(shared[0])
        shared_by_item.append(shared)
    members: dict[str, list[str]] = {}
    for key in list(parent):
        members.setdefault(find(key), []).append(key)
    for item, shared in zip(items, shared_by_item):
        if shared and not any(item.iter_markers("xdist_group")):
            group = min(members[find(shared[0])])
            item.add_marker(pytest.mark.xdist_group(SAME_RUN_AS.get(group, group)))


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """`Accelerator` is a process-wide singleton: give each test a fresh one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def nan_batch_rank1_run(tmp_path_factory):
    """One real 2-process trainer run with a NaN micro-batch on rank 1 at step 4 (checkpoints every 3 of 9 steps, rank
    1 SIGKILLed at step 8 and the job restarted from step 6, the dashboard written): the kill launch of the
    conformance matrix's DDP row (tests/scripts/conformance_reference.py, tests/test_conformance.py), shared by the
    tests that read what it leaves behind: the lockstep skip and the incident bundle (tests/test_train.py), the
    bundle's replay and the dashboard (tests/test_incident_e2e.py), the docs' commands on it. Tests only add files to
    it (a replay report); none changes what another reads. Its readers join the row's xdist group (the run is built
    once per session either way)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    import conformance_reference as reference

    return reference.shared_row(tmp_path_factory, "ddp")[0] / "kill"


# ---------------------------------------------------------------- CPU seconds per test
# CI is CPU-bound on its two cores, so what to share or shorten is read off CPU seconds (this process and every
# subprocess it waited for: the launchers and their ranks), not off wall time, which a sleeping test inflates.
def _cpu_seconds() -> float:
    import resource

    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def _add_cpu_seconds(item):
    before = _cpu_seconds()
    try:
        return (yield)
    finally:
        item.user_properties.append(("cpu_seconds", _cpu_seconds() - before))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _add_cpu_seconds(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _add_cpu_seconds(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _add_cpu_seconds(item))


_CPU_BY_TEST: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """On the controller too (pytest-xdist sends each report with its user properties): the test's total."""
    if report.when == "teardown":
        _CPU_BY_TEST[report.nodeid] = sum(v for k, v in report.user_properties if k == "cpu_seconds")


def pytest_terminal_summary(terminalreporter):
    if not _CPU_BY_TEST:
        return
    if os.environ.get("VIDSTAB_TEST_CPU_JSON"):  # every test's CPU seconds, for finding what CI's time goes to
        with open(os.environ["VIDSTAB_TEST_CPU_JSON"], "w") as f:
            json.dump(_CPU_BY_TEST, f, indent=1)
    top = sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:25]
    terminalreporter.write_sep("=", f"most CPU seconds (of {sum(_CPU_BY_TEST.values()):.0f} s in all)")
    for nodeid, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
