"""Skips are allowed in CI only where tests/skip_allowlist.txt says why CI cannot run the test.

With CI=true in the environment (CI sets it; SPECMOE_STRICT_SKIPS=1 does the same anywhere),
a skip that no entry of the list covers fails the run: the exit status is 1 and the summary
names each such skip. A module skipped whole (a module-level skip or importorskip) counts
like a test. Each entry of the list is one line::

    test | reason | why CI cannot run it

`test` is a node id pattern (fnmatch: tests/test_cuda.py::*), `reason` a pattern the skip's
reason must match (the condition), and `why` says why the condition holds in CI. Used as a
plugin by tests/conftest.py; SPECMOE_SKIP_ALLOWLIST names another list (for its own test).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ALLOWLIST = Path(__file__).with_name("skip_allowlist.txt")


@dataclass(frozen=True)
class Entry:
    test: str
    reason: str
    why: str


def load(path: Path) -> list[Entry]:
    entries = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split(" | ")]
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"{path}:{n}: an entry is 'test | reason | why', got {line!r}")
        entries.append(Entry(*parts))
    return entries


def covering(entries: list[Entry], nodeid: str, reason: str) -> Entry | None:
    return next((e for e in entries if fnmatch.fnmatchcase(nodeid, e.test) and fnmatch.fnmatchcase(reason, e.reason)),
                None)


def strict() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1") or os.environ.get("SPECMOE_STRICT_SKIPS") == "1"


def skip_reason(report) -> str | None:
    """The reason of a skipped test or collector report (an xfail is not a skip), else None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return message.removeprefix("Skipped: ")


class SkipPolicy:
    """Collects the skips no entry covers, in the process that reports the run (xdist's controller)."""

    def __init__(self, entries: list[Entry], path: Path):
        self.entries, self.path = entries, path
        self.uncovered: list[tuple[str, str]] = []

    def _seen(self, report) -> None:
        reason = skip_reason(report)
        if reason is not None and covering(self.entries, report.nodeid, reason) is None:
            self.uncovered.append((report.nodeid or ".", reason))

    def pytest_runtest_logreport(self, report):
        self._seen(report)

    def pytest_collectreport(self, report):
        self._seen(report)

    def pytest_sessionfinish(self, session):
        if self.uncovered:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if not self.uncovered:
            return
        terminalreporter.section(f"skips not on {self.path.name} (CI=true: each fails the run)", red=True)
        for nodeid, reason in self.uncovered:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(f"Make the test run here, or add 'test | reason | why CI cannot run it' to {self.path}.")


def pytest_configure(config):
    if strict() and not hasattr(config, "workerinput"):  # xdist's workers forward their reports
        path = Path(os.environ.get("SPECMOE_SKIP_ALLOWLIST") or ALLOWLIST)
        config.pluginmanager.register(SkipPolicy(load(path), path), "specmoe-skip-policy")
