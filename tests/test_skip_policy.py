"""With CI=true a skip fails the run unless tests/skip_allowlist.txt covers the test and its
reason (tests/skip_policy.py). Checked on a pytest run of sample tests in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from skip_policy import ALLOWLIST, covering, load

TESTS = Path(__file__).resolve().parent
SAMPLE = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("needs a unicorn")
"""
MODULE_SKIP = 'import pytest\n\npytest.skip("no unicorn here", allow_module_level=True)\n'


def run_pytest(tmp_path, allowlist: str, ci: str = "true", module_skip: bool = False):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    if module_skip:
        (tmp_path / "test_module.py").write_text(MODULE_SKIP)
    (tmp_path / "allow.txt").write_text(allowlist)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "SPECMOE_STRICT_SKIPS"}
    env.update(CI=ci, SPECMOE_SKIP_ALLOWLIST=str(tmp_path / "allow.txt"), PYTHONPATH=str(TESTS),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "skip_policy", "-p", "no:cacheprovider", "-q",
                           "-rs", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_in_ci_a_skip_without_an_entry_fails_the_run_and_is_named(tmp_path):
    proc = run_pytest(tmp_path, "", module_skip=True)
    assert proc.returncode == 1, proc.stdout
    assert "test_sample.py::test_skips: needs a unicorn" in proc.stdout
    assert "test_module.py: no unicorn here" in proc.stdout  # a module skipped whole counts too
    assert "1 passed, 2 skipped" in proc.stdout


def test_in_ci_an_entry_for_the_test_and_its_reason_lets_the_skip_pass(tmp_path):
    proc = run_pytest(tmp_path, "# comment\ntest_sample.py::test_s* | needs a * | no unicorns in CI\n")
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout and "skip_allowlist" not in proc.stdout


@pytest.mark.parametrize("entry", ["test_sample.py::test_skips | needs a GPU | CI has none",
                                   "test_other.py::test_skips | needs a unicorn | wrong test"])
def test_in_ci_an_entry_for_another_reason_or_test_does_not_cover_the_skip(tmp_path, entry):
    assert run_pytest(tmp_path, entry + "\n").returncode == 1


def test_outside_ci_a_skip_is_only_reported(tmp_path):
    proc = run_pytest(tmp_path, "", ci="false")
    assert proc.returncode == 0 and "SKIPPED [1] test_sample.py:8: needs a unicorn" in proc.stdout


def test_a_malformed_entry_is_an_error_naming_its_line(tmp_path):
    (tmp_path / "allow.txt").write_text("# ok\ntests/test_x.py::* | needs a GPU\n")
    with pytest.raises(ValueError, match="allow.txt:2: an entry is 'test | reason | why'"):
        load(tmp_path / "allow.txt")


def test_the_repositorys_list_covers_exactly_the_skips_ci_cannot_avoid():
    entries = load(ALLOWLIST)
    for e in entries:  # every entry names an existing test file
        assert (TESTS.parent / e.test.split("::")[0]).is_file(), e
    assert covering(entries, "tests/test_cuda.py::test_host_store_is_pinned_on_cuda", "needs a CUDA device")
    assert covering(entries, "tests/test_server_live.py::test_x[cuda]", "needs CUDA")
    assert not covering(entries, "tests/test_server_live.py::test_x[cpu]", "needs CUDA")
    int8 = "tests/test_quantized_drafts.py::test_the_int8_kernel_layout_computes_what_the_portable_format_does[48]"
    assert covering(entries, int8, "the int8 kernel is not used here: self-check crashed (signal 11)")
    assert not covering(entries, int8, "the int8 kernel is not used here: SPECMOE_FUSED_KERNELS=off")
    # a condition CI has must never be on the list: namespaces, O_DIRECT, Chromium, a checkout
    for nodeid, reason in [("tests/test_faults.py::test_a_read_only_offload_dir_is_one_line", "no namespace"),
                           ("tests/test_stored_dtype.py::test_x", "refuses O_DIRECT"),
                           ("tests/test_ui_browser.py", "the browser tests need Chromium"),
                           ("tests/test_cuda.py::test_x", "could not import 'compressed_tensors'")]:
        assert not covering(entries, nodeid, reason), nodeid
