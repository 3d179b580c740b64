"""The pytest plugin: a session whose harness cases (tests parametrized over `case`) were all skipped checked
nothing; it says so in the summary and exits 5 unless --allow-skips."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CASES = """
import pytest

def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", ["reference-batching", "vendored-batching"])

def test_case(case):
    {body}

def test_not_a_case():
    pass
"""


def _run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(CASES.format(body=body))
    return pytester.runpytest("-p", "harness.pytest_plugin", "-p", "no:cacheprovider", *args)


def test_all_cases_skipped_exits_5_and_says_so(pytester):
    result = _run(pytester, 'pytest.skip("engine unavailable here")')
    assert result.ret == 5
    result.stdout.fnmatch_lines(["*bamba-harness: nothing checked: all 2 selected harness cases were skipped "
                                 "(exit status 5; --allow-skips accepts that)*"])


def test_allow_skips_keeps_exit_0_and_still_says_so(pytester):
    result = _run(pytester, 'pytest.skip("engine unavailable here")', "--allow-skips")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*nothing checked: all 2 selected harness cases were skipped"])


@pytest.mark.parametrize("body", [
    'pytest.skip("no GPU") if case.startswith("vendored") else None',
    'pytest.xfail("known difference")',
], ids=["one-ran", "xfail-ran"])
def test_a_case_that_ran_counts_as_checked(pytester, body):
    result = _run(pytester, body)
    assert result.ret == 0
    assert "nothing checked" not in result.stdout.str()


def test_a_failure_keeps_exit_1(pytester):
    result = _run(pytester, 'pytest.skip("no GPU") if case.startswith("vendored") else pytest.fail("wrong")')
    assert result.ret == 1


@pytest.mark.slow
def test_under_xdist_the_controller_sees_the_cases(pytester):
    result = _run(pytester, 'pytest.skip("engine unavailable here")', "-n", "1")
    assert result.ret == 5
    result.stdout.fnmatch_lines(["*nothing checked: all 2 selected harness cases were skipped*"])
