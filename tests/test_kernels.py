"""The fused-kernel guard (experts/kernels.py): which matrices may go through torch's
private CPU int8 / int4 matmuls, on what memory, after which self-check; and the draft
paths that crashed on AVX-512 machines (K not a multiple of 16, weights loaded back from
the quantized-copies cache at unaligned offsets), checked against the portable path.

The guard's decisions are tested directly, so that they are tested on any CPU; the
end-to-end tests would segfault on an AVX-512 machine without the guard."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from factories import random_prompts

from specmoe import LLM, SamplingParams
from specmoe.base.errors import SpecMoEError
from specmoe.experts import copy_layouts, kernel_check, kernels
from specmoe.experts.kernels import ALIGN, Shape
from specmoe.experts.quant import (
    BlockMatrix,
    Int4KernelMatrix,
    Int8KernelMatrix,
    QuantizedMatrix,
    device_layout,
    quantize_matrix,
)
from specmoe.kernels import blockdot

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def unaligned(t: torch.Tensor, offset: int = 8) -> torch.Tensor:
    """A copy of t whose data starts `offset` bytes past a 64-byte boundary, as a tensor
    read back from a safetensors file can."""
    raw = torch.empty(t.numel() * t.element_size() + 2 * ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr() % ALIGN) + offset
    view = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % ALIGN == offset
    return view


def portable(q: QuantizedMatrix, e: int, x: torch.Tensor) -> torch.Tensor:
    return q.select(e).linear(x)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def require_fused(shape: Shape) -> None:
    """Skip where this machine's verdict keeps the kernel off `shape`: the test would compare
    the portable path with itself. The skip shows (CI allows it only after a failed
    self-check, tests/skip_allowlist.txt); the guard tests below run on every CPU."""
    choice = kernels.choose([shape], CPU)[shape]
    if not choice.fused:
        pytest.skip(f"the {shape.kernel} kernel is not used on this machine for {shape.key}: {choice.why}")


# --- memory the kernels are handed ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 48, 32), (5, 7, 16), (2, 3)], ids=["48x32", "7x16", "1-d rows"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_aligned_stack_starts_every_expert_on_a_64_byte_boundary(shape, dtype):
    t = unaligned((torch.randn(shape) * 50).to(dtype))
    s = kernels.aligned_stack(t)
    assert torch.equal(s, t)
    for e in range(shape[0]):
        assert s[e].is_contiguous() and s[e].data_ptr() % ALIGN == 0
    per = kernels.padded(t[0].numel(), t.element_size())
    assert kernels.stack_bytes(s, stacked=True) == shape[0] * per * t.element_size()


def test_an_unaligned_matrix_is_copied_and_an_aligned_one_kept():
    t = torch.randn(16, 64).to(torch.bfloat16)
    assert kernels.aligned(t) is t
    moved = unaligned(t, 16)
    copy = kernels.aligned(moved)
    assert copy.data_ptr() % ALIGN == 0 and torch.equal(copy, t)


# In a child process, so that it runs on every CPU: torch's private op may crash on a CPU
# whose self-check failed it. The layouts are built directly (not through the verdicts),
# and what each call hands the kernel is printed before the kernel runs.
GUARDS = """
import json, sys, torch
from specmoe.experts import copy_layouts, kernels
from specmoe.experts.kernels import ALIGN
from specmoe.experts.quant import Int4KernelMatrix, Int8KernelMatrix, QuantizedMatrix, quantize_matrix

def say(**kw):
    print(json.dumps(kw), flush=True)

def unaligned(t, offset=8):
    raw = torch.empty(t.numel() * t.element_size() + 2 * ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr() % ALIGN) + offset
    view = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view

kernel = sys.argv[1]
gen = torch.Generator().manual_seed(1)
x = torch.randn(16, 128, generator=gen)
# the refusal comes before torch's op: unaligned weights raise, whatever the CPU
codes = unaligned(torch.randint(-127, 127, (32, 128), dtype=torch.int8))
try:
    if kernel == "int8":
        kernels.int8_mm(x.bfloat16(), codes, torch.ones(32, dtype=torch.bfloat16))
    else:
        kernels.int4_mm(x.bfloat16(), unaligned(torch.zeros(32, 64, dtype=torch.uint8)), 128,
                        torch.zeros(1, 32, 2, dtype=torch.bfloat16))
    say(refused=None)
except RuntimeError as exc:
    say(refused=str(exc))

def watch(original):
    def call(x, w, *rest):
        say(handed=[t.data_ptr() % ALIGN for t in (w, rest[-1])], contiguous=w.is_contiguous() and rest[-1].is_contiguous())
        return original(x, w, *rest)
    return call

copy_layouts.int8_mm, copy_layouts.int4_mm = watch(kernels.int8_mm), watch(kernels.int4_mm)
bits = 8 if kernel == "int8" else 4
q = quantize_matrix(torch.randn(4, 32, 128, generator=gen) * 0.1, bits)
moved = QuantizedMatrix(unaligned(q.data), unaligned(q.scales, 24), bits, 128)  # read back 8 and 24 bytes off
layout = Int8KernelMatrix.from_quantized(moved) if bits == 8 else Int4KernelMatrix.from_quantized(moved)
held = (layout.codes, layout.scales) if bits == 8 else (layout.packed, layout.scales_zeros)
say(layout=[t[e].data_ptr() % ALIGN for e in range(4) for t in held])
for e in range(4):
    got = layout.select(e).linear(x)
    say(error=float((got - q.select(e).linear(x)).norm() / q.select(e).linear(x).norm()))
"""


@pytest.mark.parametrize("kernel", ["int8", "int4"])
def test_the_alignment_and_refusal_guards_hold_on_any_cpu(kernel):
    """Unaligned weights are refused before torch's op; weights read back at unaligned
    offsets are copied into aligned storage, and each expert's view handed to the kernel is
    aligned. The numbers are checked only where the self-check passed the kernel; a crash
    inside torch's op only where it failed it."""
    run = subprocess.run([sys.executable, "-c", GUARDS, kernel], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    refused = [m["refused"] for m in lines if "refused" in m]
    assert refused and refused[0] is not None and "64-byte aligned" in refused[0], (refused, run.stderr[-2000:])
    shape = Shape(kernel, 32, 128, 128 if kernel == "int4" else 0)
    fused = kernels.choose([shape], CPU)[shape].fused
    crashed = run.returncode < 0  # a signal: inside torch's op
    assert run.returncode == 0 or (crashed and not fused), run.stderr[-2000:]
    layouts = [m["layout"] for m in lines if "layout" in m]
    handed = [m for m in lines if "handed" in m]
    assert all(m["handed"] == [0, 0] and m["contiguous"] for m in handed), handed
    # a whole run hands the kernel 4 experts; a crash comes in int4's conversion (no layout) or the first call
    assert (layouts, len(handed)) == ([[0] * 8], 4) or (crashed and (layouts, len(handed)) in (([], 0), ([[0] * 8], 1)))
    errors = [m["error"] for m in lines if "error" in m]
    assert not fused or (len(errors) == 4 and max(errors) < 1e-2), errors
    if not layouts:
        require_fused(shape)  # only the refusal ran: the skip shows it


def test_weights_loaded_at_an_unaligned_offset_reach_the_int8_kernel_aligned(monkeypatch):
    """A stacked int8 matrix whose codes and scales start 8 bytes off (a cache file's
    tensors): every expert's view the kernel sees is aligned, and computes the portable result."""
    q = quantize_matrix(torch.randn(4, 48, 64, generator=torch.Generator().manual_seed(1)) * 0.1, 8)
    moved = QuantizedMatrix(unaligned(q.data), unaligned(q.scales, 24), 8, 64)
    seen = []
    original = kernels.int8_mm

    def watch(x, codes, scales):
        seen.append((codes.data_ptr() % ALIGN, scales.data_ptr() % ALIGN, codes.is_contiguous()))
        return original(x, codes, scales)

    monkeypatch.setattr(copy_layouts, "int8_mm", watch)
    require_fused(Shape("int8", 48, 64))
    k = device_layout(moved, CPU)
    assert isinstance(k, Int8KernelMatrix)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for e in range(4):
        assert rel(k.select(e).linear(x), portable(q, e, x)) < 1e-2
    assert seen == [(0, 0, True)] * 4


# --- which shapes, which machine ---------------------------------------------------------------


@pytest.mark.parametrize("in_features", [8, 24, 40, 136])
def test_an_int8_matrix_whose_k_is_not_a_multiple_of_16_takes_the_portable_path(in_features):
    q = quantize_matrix(torch.randn(3, 32, in_features, generator=torch.Generator().manual_seed(3)), 8)
    choice = kernels.choose([Shape("int8", 32, in_features)], CPU)[Shape("int8", 32, in_features)]
    assert not choice.fused and f"K = {in_features}" in choice.why
    layout = device_layout(unaligned_matrix(q), CPU)
    assert isinstance(layout, QuantizedMatrix)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(4))
    assert torch.equal(layout.select(1).linear(x), portable(q, 1, x))


@pytest.mark.parametrize("in_features,fused", [(40, False), (128, True)], ids=["K=40", "K=128"])
def test_int4_copies_read_back_unaligned_compute_what_the_portable_format_does(in_features, fused):
    """int4 with K = 40 has no kernel group (its group is the whole row): portable. With
    K = 128 the kernel's layout is rebuilt in fresh, aligned storage whatever the codes' offset."""
    q = quantize_matrix(torch.randn(3, 32, in_features, generator=torch.Generator().manual_seed(5)) * 0.1, 4)
    shape = Shape("int4", 32, in_features, q.group)
    if fused:
        require_fused(shape)
    layout = device_layout(unaligned_matrix(q), CPU)
    assert isinstance(layout, Int4KernelMatrix) == fused
    for e in range(3 if fused else 0):
        assert kernels.is_aligned(layout.select(e).packed) and kernels.is_aligned(layout.select(e).scales_zeros)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(6))
    for e in range(3):
        assert rel(layout.select(e).linear(x), portable(q, e, x)) < 1e-2


def unaligned_matrix(q: QuantizedMatrix) -> QuantizedMatrix:
    return QuantizedMatrix(unaligned(q.data), unaligned(q.scales), q.bits, q.in_features)


@pytest.mark.parametrize("shape,why", [
    (Shape("int4", 40, 128, 32), "N = 40"),
    (Shape("int4", 64, 96, 24), "group 24"),
    (Shape("int8", 64, 24), "K = 24"),
], ids=["int4-rows", "int4-group", "int8-k"])
def test_shapes_a_kernel_cannot_take_are_refused_before_any_check(shape, why):
    assert why in kernels.requirement(shape)
    assert kernels.requirement(Shape("int8", 64, 64)) is None


def test_fused_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECMOE_FUSED_KERNELS", "off")
    choice = kernels.choose([Shape("int8", 64, 64)], CPU)[Shape("int8", 64, 64)]
    assert not choice.fused and "SPECMOE_FUSED_KERNELS=off" in choice.why
    # torch's kernels off: specmoe's block kernels take the copy where they run, else it is dequantized per call
    assert isinstance(device_layout(quantize_matrix(torch.randn(64, 64), 8), CPU),
                      BlockMatrix if blockdot.available() else QuantizedMatrix)
    assert isinstance(device_layout(quantize_matrix(torch.randn(64, 48), 8), CPU), QuantizedMatrix)  # K % 32 != 0
    monkeypatch.setenv("SPECMOE_FUSED_KERNELS", "maybe")
    with pytest.raises(SpecMoEError, match="SPECMOE_FUSED_KERNELS='maybe'.*'off'"):
        kernels.choose([Shape("int8", 64, 64)], CPU)


def test_off_the_cpu_no_fused_kernel_is_chosen():
    choice = kernels.choose([Shape("int8", 64, 64)], torch.device("meta"))[Shape("int8", 64, 64)]
    assert not choice.fused


# --- the self-check ---------------------------------------------------------------------------------


def child(script: str) -> list[str]:
    return [sys.executable, "-c", "import json, os, signal, sys\ncases = json.loads(sys.argv[1])['cases']\n" + script]


CRASHES_ON_64 = child("""
for i, c in enumerate(cases):
    print(json.dumps({"begin": i}), flush=True)
    if c["in"] == 64:
        os.kill(os.getpid(), signal.SIGSEGV)
    print(json.dumps({"case": i, "error": 0.001}), flush=True)
""")


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_kernel_that_crashes_its_self_check_is_not_used_and_a_warning_says_so(fresh_cache, capsys):
    shapes = [Shape("int8", 32, 32), Shape("int8", 32, 64), Shape("int8", 32, 128)]
    got = kernels.verdicts(shapes, child=CRASHES_ON_64)
    assert got[shapes[1]] == (False, "self-check crashed (signal 11)")
    assert got[shapes[0]][0] and got[shapes[2]][0]  # the cases after the crash ran in a fresh child
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "int8 N=32 K=64" in err and "crashed" in err
    # kept for this machine: the engine's choice now reads the verdict, no child runs
    choice = kernels.choose([shapes[1]], CPU)[shapes[1]]
    assert not choice.fused and choice.describe() == "portable: self-check crashed (signal 11)"
    kept = json.loads((fresh_cache / "kernels.json").read_text())
    assert kept[kernels.machine()]["int8 N=32 K=64"]["fused"] is False


def test_a_kernel_that_computes_wrong_numbers_is_not_used(fresh_cache):
    wrong = child("""
print(json.dumps({"begin": 0}), flush=True)
print(json.dumps({"case": 0, "error": 0.31}), flush=True)
print(json.dumps({"begin": 1}), flush=True)
print(json.dumps({"case": 1, "error": None}), flush=True)
""")
    shapes = [Shape("int8", 32, 32), Shape("int4", 32, 64, 64)]
    got = kernels.verdicts(shapes, child=wrong)
    assert got[shapes[0]] == (False, "self-check: relative error 0.31 against the dequantizing path")
    assert got[shapes[1]] == (False, "self-check: the result is not finite")


def test_a_self_check_that_cannot_start_disables_every_shape_it_was_given(fresh_cache):
    shapes = [Shape("int8", 32, 32), Shape("int8", 64, 32)]
    got = kernels.verdicts(shapes, child=[sys.executable, "-c", "import sys; sys.exit('no torch here')"])
    assert all(not ok and "could not run" in why and "no torch here" in why for ok, why in got.values())


def test_a_self_check_that_hangs_is_stopped_and_counts_as_failed(fresh_cache, monkeypatch):
    monkeypatch.setattr(kernels, "CHECK_TIMEOUT_S", 2)
    hangs = child("""
print(json.dumps({"begin": 0}), flush=True)
import time; time.sleep(60)
""")
    got = kernels.verdicts([Shape("int8", 32, 32)], child=hangs)
    assert got[Shape("int8", 32, 32)] == (False, "self-check timed out after 2 s")


def test_a_damaged_verdict_file_is_ignored_and_rebuilt(fresh_cache, capsys):
    fresh_cache.mkdir(parents=True)
    (fresh_cache / "kernels.json").write_text(json.dumps({kernels.machine(): {"int8 N=32 K=32": {"fused": "yes"}}}))
    got = kernels.verdicts([Shape("int8", 32, 32)], child=CRASHES_ON_64)
    assert got[Shape("int8", 32, 32)] == (True, "self-check passed (relative error 1.0e-03)")
    assert "ignoring" in capsys.readouterr().err
    assert json.loads((fresh_cache / "kernels.json").read_text())[kernels.machine()]["int8 N=32 K=32"]["fused"]


def test_the_self_check_tells_a_wrong_kernel_from_a_right_one():
    """kernel_check's comparison, in this process with stand-in kernels: garbage, NaN and
    a product off by one bfloat16 rounding."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(32, 64, generator=gen)
    right = kernel_check.relative_error(lambda x: x @ weights.bfloat16().t(), weights, gen)
    garbage = kernel_check.relative_error(lambda x: torch.randn(x.shape[0], 32, generator=gen), weights, gen)
    nan = kernel_check.relative_error(lambda x: torch.full((x.shape[0], 32), float("nan")), weights, gen)
    assert right < kernels.TOLERANCE < garbage and nan == float("inf")


def test_the_real_self_check_runs_the_kernels_in_a_child_here(fresh_cache):
    shapes = [Shape("int8", 64, 64), Shape("int4", 64, 128, 64)]
    got = kernels.verdicts(shapes)
    for ok, why in got.values():
        assert why.startswith("self-check"), why  # a verdict from the kernel itself, not "could not run"
    assert (fresh_cache / "kernels.json").is_file()


# --- the draft paths that crashed ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def k24_checkpoint(tiny_ckpt):
    """The tiny Mixtral: hidden 32 (int8 kernel), experts 24 wide (down's K = 24: portable)."""
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(6, 128, 3, 10, seed=7)
    ref = LLM(model=str(path), device="cpu", max_batch_size=6, max_model_len=40)
    ref.generate(prompts, GREEDY)
    ref.close()
    return path, prompts, ref.last_stats["token_ids_sha256"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_second_run_from_the_copies_cache_gives_residents_tokens(k24_checkpoint, tmp_path, mode, monkeypatch):
    """The path that segfaulted: the second run reads the copies back from their
    safetensors cache file; every tensor a fused kernel is handed is aligned."""
    path, prompts, sha = k24_checkpoint
    handed = []
    for name in ("int8_mm", "int4_mm"):
        original = getattr(kernels, name)

        def watch(x, w, *rest, _original=original):
            handed.append(all(t.data_ptr() % ALIGN == 0 for t in (w, rest[-1])))
            return _original(x, w, *rest)

        monkeypatch.setattr(copy_layouts, name, watch)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(path), device="cpu", policy="specmoe", offload="host", draft_quant=mode, gamma=3,
                  offload_dir=str(tmp_path), max_batch_size=6, max_model_len=40)
        llm.generate(prompts, GREEDY)
        runs.append(llm.last_stats)
        llm.close()
    assert [r["token_ids_sha256"] for r in runs] == [sha, sha]
    assert len(list(tmp_path.glob(f"quant-*-{mode}-*.safetensors"))) == 1  # the second run read it back
    kernels_used = runs[1]["fused_kernels"]
    if mode == "int8":
        assert kernels_used["draft int8 N=32 K=24"].startswith("portable: K = 24")
    fused = [key for key, why in kernels_used.items() if why.startswith("fused")]
    assert all(handed) and bool(handed) == bool(fused)
    if not fused:  # the tokens above are the portable path's: the kernels' part did not run here
        key, why = next(((k, w) for k, w in kernels_used.items() if mode in k and "self-check" in w),
                        next(iter(kernels_used.items())))
        pytest.skip(f"the {mode} kernel is not used on this machine for {key.removeprefix('draft ')}: "
                    f"{why.removeprefix('portable: ')}")


def test_the_machine_section_names_the_shapes_that_passed_and_why_others_did_not():
    from specmoe.bench.tables import fused_kernels

    line = fused_kernels({"int8 N=256 K=256": "fused: self-check passed (relative error 2.0e-03)",
                          "int8 N=2048 K=2048": "portable: self-check crashed (signal 11)",
                          "int4 N=256 K=256 group=128": "fused: self-check passed (relative error 1.7e-03)"})
    assert line == ("int8: passed N=256 K=256; N=2048 K=2048 portable: self-check crashed (signal 11) · "
                    "int4: passed N=256 K=256 group=128")


def test_calibrate_reports_the_kernels_for_the_demo_and_a_real_size_expert(fresh_cache):
    from specmoe.tools.calibrate import fused_kernel_report

    report = fused_kernel_report()
    assert set(report) == {"int8 N=256 K=256", "int8 N=256 K=128", "int8 N=4096 K=2048", "int8 N=2048 K=2048",
                           "int4 N=256 K=256 group=128", "int4 N=256 K=128 group=128",
                           "int4 N=4096 K=2048 group=128", "int4 N=2048 K=2048 group=128"}
    assert all(why.startswith(("fused: self-check", "portable: self-check")) for why in report.values())
    # what the engine would choose for each shape on this machine, fused or not
    kept = json.loads((fresh_cache / "kernels.json").read_text())[kernels.machine()]
    assert {key: ("fused: " if v["fused"] else "portable: ") + v["why"] for key, v in kept.items()} == report


def test_the_real_size_section_says_whether_each_run_exited_fit_its_bound_and_matched_resident():
    from specmoe.bench.tables import real_size_runs

    gib = 1 << 30
    run = {"exit_status": 0, "wall_s": 40.2, "startup_s": 30.0, "peak_anon_bytes": 2 * gib, "host_peak_bytes": 3 * gib,
           "decode_tokens_per_s": 25.0, "device_memory": 2 * gib, "token_ids_sha256": "a", "fused_kernels": {}}
    doc = {"batch_size": 16, "max_tokens": 32, "expert_bytes": 3 * gib, "runs": [
        {**run, "run": "resident", "device_memory": None},
        {**run, "run": "specmoe, first run", "peak_anon_bytes": 3 * gib,
         "fused_kernels": {"draft int8 N=4096 K=2048": "fused: self-check passed (relative error 1.7e-03)"}},
        {**run, "run": "specmoe, from the caches", "exit_status": -11, "token_ids_sha256": None}]}
    text = real_size_runs(doc)
    rows = text.splitlines()[4:]
    assert "10.0 s per GiB of experts (3.00 GiB in bf16)" in text  # 30 s of start-up over 3 GiB
    assert rows[0] == "| resident | 0 | 30 s | 40 s | 2.00 GiB | – | – | 3.00 GiB | 25.0 | – | – |"
    # 3 GiB against 1.15 x 2 GiB + 256 MiB = 2.55 GiB: over its bound
    assert rows[1].endswith("| 3.00 GiB | 2.55 GiB | NO | 3.00 GiB | 25.0 | yes | int8: passed N=4096 K=2048 |")
    assert rows[2].startswith("| specmoe, from the caches | -11 |") and "| yes | 3.00 GiB | 25.0 | NO |" in rows[2]


def test_the_real_size_section_compares_start_up_with_another_revision_median_against_median():
    from specmoe.bench.tables import real_size_runs

    run = {"run": "resident", "exit_status": 0, "wall_s": 9.0, "startup_s": 8.0, "peak_anon_bytes": 1 << 30,
           "token_ids_sha256": "a"}
    rounds = [{"round": i, "source": src, "exit_status": 0, "startup_s": t}
              for i, (a, b) in enumerate([(40.0, 55.0), (50.0, 65.0), (45.0, 60.0)])
              for src, t in (("this tree", a), ("abc1234", b))]
    doc = {"batch_size": 16, "max_tokens": 32, "expert_bytes": 1 << 30, "runs": [run],
           "startup_against": {"rev": "abc1234", "rounds": rounds}}
    assert "3 alternating rounds: 40, 45, 50 s against 55, 60, 65 s: 1.33x as fast" in real_size_runs(doc)  # 60 / 45


def test_the_real_size_section_compares_warm_start_ups_median_against_median_with_the_goal():
    from specmoe.bench.tables import real_size_runs

    run = {"run": "resident", "exit_status": 0, "wall_s": 9.0, "startup_s": 8.0, "peak_anon_bytes": 1 << 30,
           "token_ids_sha256": "a"}

    def doc(specmoe_times):
        rounds = [{"round": i, "policy": p, "exit_status": 0, "startup_s": t}
                  for i, (a, b) in enumerate(zip([6.0, 8.0, 7.0], specmoe_times))
                  for p, t in (("ondemand", a), ("specmoe", b))]
        return {"batch_size": 16, "max_tokens": 32, "expert_bytes": 1 << 30, "runs": [run], "warm_startup": rounds}

    # medians 10.5 against 7: 1.5x, the goal's edge; the first round's 30 s does not move a median
    assert ("SpecMoE 9.0, 10.5, 30.0 s against ondemand's 6.0, 7.0, 8.0 s: 1.50x (median against median; goal at "
            "most 1.5x: met)") in real_size_runs(doc([30.0, 9.0, 10.5]))
    assert "1.57x (median against median; goal at most 1.5x: not met)" in real_size_runs(doc([11.0, 9.0, 12.0]))
