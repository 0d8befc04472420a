"""Test kinds: every test is exactly one of `unit`, `stack` and `slow` (docs/testing.md).

stack: starts real services as processes (Triton, the drafter, the orchestrator, Prometheus,
    a whole `flashmap up` stack). A test in one of STACK_MODULES is stack unless it carries
    another kind; a stack test elsewhere carries @pytest.mark.stack.
slow: in-process but long (over about 5 s on two cores: training runs, torch.compile,
    subprocess pipelines); each carries @pytest.mark.slow.
unit: the rest, marked here. `bash scripts/test.sh -m unit` is the fast loop.

A test with two kinds stops the run at collection, as does a name in STACK_MODULES that is no
test file. After the run, a unit test whose body took longer than UNIT_WARN_S is listed, so a
slow test that lost (or never had) its mark shows up in the fast loop's own output.

The test process computes on one torch thread: the models here are tiny, and a second thread
spins against the other processes of a busy two-core machine (the suite takes far longer).
Services and other child processes get their settings from the tests that start them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_markers.py runs these rules on a made-up suite

KINDS = ("unit", "stack", "slow")

# Test files whose tests start services, but for those marked unit or slow; the other files
# mark their stack tests one by one.
STACK_MODULES = frozenset(
    {
        "test_drafter_service.py",
        "test_loadgen.py",
        "test_observability_live.py",
        "test_openai_api.py",
        "test_openai_chat.py",
        "test_readme.py",
        "test_security.py",
        "test_stack.py",
        "test_triton_target.py",
    }
)

UNIT_WARN_S = 5.0

_unit_ids: set[str] = set()
_unit_seconds: dict[str, float] = {}


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    missing = sorted(n for n in STACK_MODULES if not (here / n).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py STACK_MODULES names no test file: {missing}")
    for item in items:
        kinds = sorted({m.name for m in item.iter_markers() if m.name in KINDS})
        if len(kinds) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(kinds)}: one kind only")
        if not kinds:
            kinds = ["stack" if item.path.name in STACK_MODULES else "unit"]
            item.add_marker(kinds[0])
        if kinds == ["unit"]:
            _unit_ids.add(item.nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.nodeid in _unit_ids:
        _unit_seconds[report.nodeid] = report.duration


def pytest_terminal_summary(terminalreporter):
    slow = sorted(((s, n) for n, s in _unit_seconds.items() if s > UNIT_WARN_S), reverse=True)
    if slow:
        terminalreporter.section(f"unit tests over {UNIT_WARN_S:g} s (mark them slow or stack?)")
        for s, n in slow:
            terminalreporter.write_line(f"{s:7.2f}s {n}")
