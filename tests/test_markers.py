"""The rules of tests/conftest.py: every test is exactly one of unit, stack and slow."""

from pathlib import Path

import pytest

from tests.conftest import KINDS, STACK_MODULES

CONFTEST = Path(__file__).with_name("conftest.py").read_text()


def test_every_test_of_this_run_has_one_kind(request):
    for item in request.session.items:
        assert len({m.name for m in item.iter_markers() if m.name in KINDS}) == 1, item.nodeid


@pytest.fixture
def suite(pytester):
    """A made-up suite under these rules: every file of STACK_MODULES, and one that is not."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    unit\n    stack\n    slow\n"
    )
    stack = sorted(STACK_MODULES)
    for name in stack:
        pytester.makepyfile(**{name[:-3]: "def test_service(): pass\n"})
    pytester.makepyfile(
        **{
            stack[0][:-3]: "import pytest\n\ndef test_service(): pass\n\n"
            "@pytest.mark.unit\ndef test_no_service(): pass\n",
            "test_plain": "import pytest\n\ndef test_quick(): pass\n\n"
            "@pytest.mark.slow\ndef test_long(): pass\n\n"
            "@pytest.mark.stack\ndef test_service(): pass\n",
        }
    )
    return pytester, stack


def _selected(pytester, kind: str) -> set[str]:
    result = pytester.runpytest("--collect-only", "-q", "-m", kind)
    assert result.ret == 0, result.stdout.str()
    return {line for line in result.outlines if "::" in line}


def test_unmarked_tests_are_unit_or_stack_by_their_file(suite):
    pytester, stack = suite
    assert _selected(pytester, "unit") == {
        f"{stack[0]}::test_no_service",
        "test_plain.py::test_quick",
    }
    assert _selected(pytester, "stack") == {
        *(f"{name}::test_service" for name in stack),
        "test_plain.py::test_service",
    }
    assert _selected(pytester, "slow") == {"test_plain.py::test_long"}


def test_two_kinds_or_a_stale_table_stop_the_run(suite):
    pytester, stack = suite
    pytester.makepyfile(
        test_both="import pytest\n\n@pytest.mark.slow\n@pytest.mark.stack\ndef test_x(): pass\n"
    )
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test_both.py::test_x is marked slow and stack: one kind only" in result.stderr.str()
    (pytester.path / "test_both.py").unlink()
    (pytester.path / stack[-1]).unlink()  # a stack file renamed: its tests would become unit
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"STACK_MODULES names no test file: ['{stack[-1]}']" in result.stderr.str()
