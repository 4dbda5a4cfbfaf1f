"""Shared fixtures. tests/ goes on sys.path so tests can ``from factories import ...``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


# The files that take longest (benches, the kernels' self-checks, transformers' parity runs, the
# families' disk tier, a browser, servers started and stopped), longest first, as measured
# with --durations=0 on a 2-core Intel Xeon (sum of setup, call and teardown per file):
# `make test` runs the suite on two workers, one file to a worker at a time, and a long file
# started last would leave the other worker idle at the end. The long scenarios (a Ray
# cluster, the memory cgroup runs, lm-eval, the soak, a server's drain) are the slow set:
# make test leaves them out (pyproject.toml), .ci/run runs them after, in this order too.
LONGEST_FIRST = ("test_host_memory.py", "test_distributed.py", "test_lm_eval.py", "test_soak.py",
                 "test_server_lifecycle.py", "test_bench.py", "test_quantized_checkpoints.py", "test_kernels.py",
                 "test_families.py", "test_ui_browser.py", "test_autotune_calibrate.py", "test_blockdot.py",
                 "test_gguf_invariance.py", "test_server_fuzz.py", "test_parity.py", "test_gguf_parity.py",
                 "test_pick_costs.py", "test_speculative.py", "test_policies.py", "test_draft_split.py",
                 "test_real_size_model.py", "test_faults.py", "test_profile_passes.py", "test_gguf_policies.py",
                 "test_quantized_drafts.py", "test_benchmarks_page.py", "test_expert_file.py",
                 "test_translate_demo.py", "test_memory_limit.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_configure(config):
    import skip_policy

    skip_policy.pytest_configure(config)  # CI=true: a skip not on tests/skip_allowlist.txt fails the run
    # recent pytest-xdist hands out files with the most tests first (--loadscope-reorder, on
    # by default), which put the 9-test test_distributed.py after 70 s of short files: keep
    # the order above.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each
        import torch

        from specmoe.kernels import cpu

        torch.set_num_threads(1)
        # An engine computes on every usable core by default (kernels/cpu.py): in each of two
        # workers that made two torch threads and two block-kernel threads, four on two cores,
        # spinning while they wait for one another. A worker counts as a process given one
        # CPU's quota, so engines built here take one thread (tests that need more say so);
        # the processes tests start (servers, replicas, `specmoe` runs) still see every core.
        cpu._cgroup_quota = lambda: 1


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory fixture: ``tiny_ckpt(family, layout="per_expert", shards=1, seed=0, **overrides)``.

    Builds a tiny random Hugging Face checkpoint with transformers (see factories.py) once
    per session and argument set, and returns its directory. Treat it as read-only: tests
    that damage a checkpoint copy it first (``damaged_ckpt``) or build their own.
    """
    pytest.importorskip("transformers")
    from factories import make_checkpoint

    cache: dict = {}

    def get(family: str, layout: str = "per_expert", shards: int = 1, seed: int = 0, **overrides):
        key = (family, layout, shards, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            # mktemp numbers the folders, so variants with overrides do not collide.
            out = tmp_path_factory.mktemp(f"{family}-{layout}-s{shards}")
            cache[key] = make_checkpoint(family, out, layout=layout, shards=shards, seed=seed, **overrides)
        return cache[key]

    return get


@pytest.fixture
def damaged_ckpt(tiny_ckpt, tmp_path):
    """Factory fixture: a private copy of a single-file tiny checkpoint, safe to damage."""
    import shutil

    def get(family: str = "mixtral", layout: str = "per_expert", **overrides):
        src = tiny_ckpt(family, layout=layout, shards=1, **overrides)
        dst = tmp_path / f"{family}-{layout}-damaged"
        shutil.copytree(src, dst)
        return dst

    return get


def _takes_o_direct(directory: Path) -> str | None:
    """None when a file in `directory` opens and reads with O_DIRECT (as the disk tier reads), else why not."""
    import mmap

    probe = directory / "o-direct-probe"
    try:
        probe.write_bytes(bytes(4096))
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [mmap.mmap(-1, 4096)], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    finally:
        probe.unlink(missing_ok=True)
    return None


@pytest.fixture
def direct_io_dir(tmp_path):
    """A fresh directory whose file system takes O_DIRECT: tmp_path, else one in the checkout
    (.cache/, ignored by git) or in the home directory, where /tmp is a tmpfs that refuses it.
    Only where none does, a skip (never on the allowlist: CI fails, loudly)."""
    import shutil
    import tempfile

    if not hasattr(os, "O_DIRECT") or not os.path.exists("/proc/self/io"):
        pytest.skip("O_DIRECT and /proc/self/io are Linux's")
    refused = []
    for parent in (None, Path(__file__).resolve().parents[1] / ".cache", Path.home() / ".cache"):
        try:
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            directory = tmp_path if parent is None else Path(tempfile.mkdtemp(prefix="direct-io-", dir=parent))
        except OSError as exc:
            refused.append(f"{parent}: {exc.strerror}")
            continue
        why = _takes_o_direct(directory)
        if why is None:
            yield directory
            if parent is not None:
                shutil.rmtree(directory, ignore_errors=True)
            return
        refused.append(why)
        if parent is not None:
            shutil.rmtree(directory, ignore_errors=True)
    pytest.skip(f"no directory here takes O_DIRECT ({'; '.join(refused)})")


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Expert files, affinity tables and calibrated profiles go to a per-run directory."""
    import os

    old = os.environ.get("SPECMOE_CACHE_DIR")
    os.environ["SPECMOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("specmoe-cache"))
    yield
    if old is None:
        os.environ.pop("SPECMOE_CACHE_DIR", None)
    else:
        os.environ["SPECMOE_CACHE_DIR"] = old


_KERNEL_VERDICTS: dict[tuple[str, str], tuple[bool, str]] = {}  # (machine, shape) -> (fused, why), this worker's


@pytest.fixture(autouse=True)
def _kernel_verdicts_once_per_worker(request, monkeypatch):
    """The fused kernels' self-check runs in a child process (2-4 s) for each shape a fresh
    cache dir has no verdict for: tests that start from a fresh cache dir get the verdicts
    this worker already measured on this machine. test_kernels.py checks the self-check
    itself and always runs it."""
    if request.node.path.name == "test_kernels.py":
        return
    from specmoe.experts import kernels

    measure = kernels.self_check

    def remembered(shapes, child=None):
        if child is not None:  # a test's own child: not this machine's verdict
            return measure(shapes, child)
        here = kernels.machine()
        missing = [s for s in shapes if (here, s.key) not in _KERNEL_VERDICTS]
        for shape, verdict in (measure(missing) if missing else {}).items():
            _KERNEL_VERDICTS[(here, shape.key)] = verdict
        return {s: _KERNEL_VERDICTS[(here, s.key)] for s in shapes}

    monkeypatch.setattr(kernels, "self_check", remembered)


@pytest.fixture(autouse=True, scope="session")
def _fixed_machine_profile(_private_cache_dir):
    """`--policy auto` plans from a fixed profile, never from a calibration of this machine."""
    import os

    import factories

    factories.SESSION_CACHE = Path(os.environ["SPECMOE_CACHE_DIR"])
    factories.install_fixed_profile(factories.SESSION_CACHE)
