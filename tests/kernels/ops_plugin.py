"""pytest plumbing of the op-provider switch (tests/kernels/providers.py): `--ops NAME`, the skips of what a peer does
not have, the findings pinned against a peer (strict xfails, tests/kernels/peer_findings.py), and `--ops-report PATH`,
one JSON line per kernel test with its outcome and its worst error in units of the tolerance (what
bench/kernel_conformance.py tabulates)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels import common, providers

KERNELS = Path(__file__).resolve().parent
ROOT = KERNELS.parents[1]
# set to the test's node id in the child process that runs an isolated finding's test (PeerFinding.isolate): the
# child runs it with --runxfail, and the parent's large-gpu-memory lock (conftest.py) is already held for it
ISOLATED_CHILD = "BAMBA_ISOLATED_FINDING"
ISOLATED_TIMEOUT_S = 900
_ISOLATED = pytest.StashKey()
# the modules whose tests call ops through providers.OPS; every other module under tests/kernels tests code the
# peers do not have (rotary, decode attention, top-k, our launch tables and compile checks)
PROVIDER_MODULES = {"test_ssd_scan", "test_selective_state_update", "test_causal_conv1d", "test_causal_conv1d_update",
                    "test_rms_norm_gated", "test_state_equivalence"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernels")
    group.addoption("--ops", default="vendored", choices=providers.PEER_NAMES,
                    help="whose Triton ops tests/kernels judges (default: vendored; peers load from .peers, "
                         "`make fetch-peers`)")
    group.addoption("--ops-report", default=None, metavar="PATH",
                    help="write one JSON line per tests/kernels test: outcome and worst error / tolerance")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vendored_only(reason): tests our kernels' internals; skipped under --ops PEER")
    providers.activate(config.getoption("ops"))


def plain_nodeid(item) -> str:
    """The node id without the `@group` that pytest-xdist's --dist loadgroup appends."""
    return re.sub(r"@[\w-]+$", "", item.nodeid)


def _in_kernels(item) -> bool:
    return KERNELS in Path(str(item.fspath)).resolve().parents


def pytest_collection_modifyitems(config, items) -> None:
    from tests.kernels.peer_findings import finding_for
    provider = providers.active()
    if provider.name == "vendored":
        return
    for item in items:
        if not _in_kernels(item):
            continue
        module = Path(str(item.fspath)).stem
        if module not in PROVIDER_MODULES:
            item.add_marker(pytest.mark.skip(reason=f"{provider.name}: {module} tests code the peers do not have"))
            continue
        marker = item.get_closest_marker("vendored_only")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"{provider.name}: {marker.args[0]}"))
            continue
        finding = finding_for(config.getoption("ops"), plain_nodeid(item), cuda=common.ON_GPU)
        if finding is None:
            continue
        if finding.isolate and os.environ.get(ISOLATED_CHILD) != plain_nodeid(item):   # (the child runs it --runxfail)
            item.stash[_ISOLATED] = finding
        # only an assertion of the test is the finding: a compile error or a crash where the finding expects wrong
        # numbers is another failure, and fails
        item.add_marker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=finding.reason()))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """An isolated finding's test runs in a child pytest of its own (its failure would break this process for the
    tests after it); the child's failure becomes this test's AssertionError, its pass this test's pass (a strict
    xfail then reports the finding gone)."""
    finding = pyfuncitem.stash.get(_ISOLATED, None)
    if finding is None:
        return None
    config = pyfuncitem.config
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--runxfail",
               plain_nodeid(pyfuncitem), "--ops", config.getoption("ops")]
    try:
        child = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=ISOLATED_TIMEOUT_S,
                               env={**os.environ, ISOLATED_CHILD: plain_nodeid(pyfuncitem)})
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{finding.key}: the test in a child process ran past {ISOLATED_TIMEOUT_S} s") from None
    if child.returncode == 0:
        return True
    errors = [line for line in child.stdout.splitlines() if line.startswith("E ")]
    raise AssertionError(f"in a child process (finding {finding.key}, exit {child.returncode}): "
                         + (errors[0][1:].strip() if errors else child.stdout[-500:] + child.stderr[-500:]))


@pytest.fixture(autouse=True)
def _worst_ratio(request):
    common.WORST.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    path = item.config.getoption("ops_report")
    if not path or not _in_kernels(item):
        return
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        state = "xfail" if hasattr(report, "wasxfail") and report.skipped else \
            "xpass" if hasattr(report, "wasxfail") else report.outcome
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2]
        elif report.failed:
            reason = str(report.longrepr.reprcrash.message if hasattr(report.longrepr, "reprcrash")
                         else report.longrepr).splitlines()[0][:300]
        worst = max(common.WORST) if common.WORST else None
        line = dict(ops=providers.active().name, nodeid=item.nodeid, outcome=state, worst=worst, reason=reason)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
