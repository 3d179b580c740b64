"""pytest plumbing of the op-provider switch (tests/kernels/providers.py): `--ops NAME`, the skips of what a peer does
not have, the findings pinned against a peer (strict xfails, tests/kernels/peer_findings.py), and `--ops-report PATH`,
one JSON line per kernel test with its outcome and its worst error in units of the tolerance (what
bench/kernel_conformance.py tabulates)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.kernels import common, providers

KERNELS = Path(__file__).resolve().parent
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
        finding = finding_for(config.getoption("ops"), item.nodeid)
        if finding is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=finding.reason()))


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
