"""Property-based tests (hypothesis) of what users type and what files hold: the CLI's
arguments, the prompts-file readers, the size and rate parsers, the device-memory
ledger and the sampling distribution. Any input either works or is a one-line
SpecMoEError; nothing else escapes. Example counts are small and derandomized so that
CI stays fast and repeatable."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("hypothesis")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specmoe.base.config import EngineConfig  # noqa: E402
from specmoe.base.errors import SpecMoEError  # noqa: E402
from specmoe.base.prompts import read_prompts_file  # noqa: E402
from specmoe.base.units import format_bytes, parse_batch_sizes, parse_rate, parse_size  # noqa: E402
from specmoe.cli import build_parser, main, sampling_params  # noqa: E402
from specmoe.engine.sampling import SamplingParams, target_probs  # noqa: E402
from specmoe.experts.budget import DeviceBudget  # noqa: E402
from specmoe.flags import engine_options  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW_FUZZ = settings(FUZZ, max_examples=20)

UNITS = {"": 1, "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20,
         "GiB": 2**30, "TiB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
HUGE = st.integers(-(10**400), 10**400)  # beyond float range
SIZE_LIKE = st.one_of(
    st.text(max_size=12),
    st.builds(lambda n, u, sp: f"{n}{sp}{u}", st.floats(allow_nan=True, allow_infinity=True) | st.integers(),
              st.sampled_from(sorted(UNITS)) | st.text(max_size=3), st.sampled_from(["", " "])),
)


# --- sizes and rates ---------------------------------------------------------------------------


@FUZZ
@given(SIZE_LIKE | HUGE | st.floats())
def test_a_size_is_a_positive_number_of_bytes_or_a_clear_error(text):
    try:
        value = parse_size(text)
    except SpecMoEError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(value, int) and value >= 1


@FUZZ
@given(st.integers(1, 10**6), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]))
def test_a_whole_number_with_a_unit_is_that_many_units(n, unit, space):
    assert parse_size(f"{n}{space}{unit}") == n * UNITS[unit]
    assert parse_size(f"{n}{unit.lower()}") == n * UNITS[unit]  # units are case-insensitive


@FUZZ
@given(st.integers(1, 2**50))
def test_a_formatted_size_reads_back_within_its_rounding(n):
    assert math.isclose(parse_size(format_bytes(n)), n, rel_tol=0.05)


@FUZZ
@given(SIZE_LIKE.map(lambda s: s + "/s") | SIZE_LIKE | st.floats() | HUGE)
def test_a_rate_is_a_positive_finite_number_or_a_clear_error(text):
    try:
        value = parse_rate(text)
    except SpecMoEError:
        return
    assert math.isfinite(value) and value > 0


@FUZZ
@given(st.text(alphabet="0123456789, -x", max_size=16))
def test_batch_sizes_are_sorted_unique_positive_integers_or_a_clear_error(text):
    try:
        sizes = parse_batch_sizes(text)
    except SpecMoEError:
        return
    assert sizes == sorted(set(sizes)) and sizes and all(b >= 1 for b in sizes)


# --- prompts files -----------------------------------------------------------------------------

LINE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), min_size=1, max_size=30)


@FUZZ
@given(st.lists(LINE.filter(str.strip), min_size=1, max_size=6), st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_a_text_prompts_file_gives_back_its_lines(tmp_path, prompts, newline, bom):
    path = tmp_path / "prompts.txt"
    path.write_bytes(("\ufeff" if bom else "").encode() + newline.join(prompts).encode() + newline.encode())
    assert read_prompts_file(str(path)) == prompts


@FUZZ
@given(st.lists(LINE | st.lists(st.integers(0, 10**6), min_size=1, max_size=8), min_size=1, max_size=6))
def test_a_jsonl_prompts_file_gives_back_its_prompts(tmp_path, prompts):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")
    assert read_prompts_file(str(path)) == prompts


@FUZZ
@given(st.binary(max_size=80) | st.text(max_size=40).map(str.encode), st.sampled_from([".txt", ".jsonl"]))
def test_any_prompts_file_gives_prompts_or_one_clear_error(tmp_path, data, suffix):
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(data)
    try:
        prompts = read_prompts_file(str(path))
    except SpecMoEError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
        return
    assert prompts and all(isinstance(p, str) or all(isinstance(t, int) for t in p) for p in prompts)


# --- the command line --------------------------------------------------------------------------

VALUE = st.one_of(st.text(max_size=8), st.integers(-5, 300).map(str), st.floats().map(str), SIZE_LIKE,
                  st.sampled_from(["auto", "cpu", "disk", "host", "specmoe", "ondemand", "none", "int4", "30%",
                                   "150%", "nan%", "1GiB", "200MB/s"]))
ENGINE_FLAGS = ["--device", "--dtype", "--policy", "--offload", "--offload-bandwidth", "--device-memory",
                "--max-model-len", "--gamma", "--draft-experts", "--draft-set", "--substitution", "--draft-compute",
                "--draft-quant", "--cache-fraction", "--threads"]
SAMPLING_FLAGS = ["--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop", "--batch-size"]


def parse(argv: list[str]):
    """The parsed namespace, or None when the parser refused (exit status 2, one line)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        return None


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(ENGINE_FLAGS + SAMPLING_FLAGS), VALUE), max_size=5))
def test_generate_flags_are_taken_or_refused_in_one_line(capsys, flags):
    args = parse(["generate", "prompt", *[x for flag, value in flags for x in (flag, value)]])
    err = capsys.readouterr().err
    if args is None:
        assert len(err.strip().splitlines()) == 1
        return
    try:  # what `specmoe generate` checks before loading anything
        sampling_params(args)
        EngineConfig(**engine_options(args, max_batch_size=args.batch_size or 1))
    except SpecMoEError as exc:
        assert "\n" not in str(exc)


SIMULATE_FLAGS = ["--batch-sizes", "--gamma", "--draft-experts", "--acceptance", "--tokens-per-step",
                  "--cache-fraction", "--skew", "--locality", "--context-len", "--device-memory",
                  "--prediction-accuracy", "--draft-quant"]


@SLOW_FUZZ
@given(st.lists(st.tuples(st.sampled_from(SIMULATE_FLAGS), VALUE), max_size=3))
def test_simulate_answers_any_flags_with_a_table_or_one_line(capsys, flags):
    argv = ["simulate", "--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5",
            *[x for flag, value in flags for x in (flag, value)]]
    try:
        status = main(argv)
    except SystemExit as exc:  # the parser
        status = exc.code
    out, err = capsys.readouterr()
    assert status in (0, 2), err
    if status:
        assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err


@pytest.mark.parametrize("command", sorted(build_parser()._subparsers._group_actions[0].choices))
def test_every_command_prints_its_help(capsys, command):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out


# --- the device-memory ledger ------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["reserve", "release"]), st.sampled_from("abc"), st.integers(-8, 120)),
               max_size=30)


@FUZZ
@given(st.integers(0, 100), OPS)
def test_the_ledger_never_holds_more_than_its_limit(limit, ops):
    budget = DeviceBudget(limit)
    seen_peak = 0
    for op, item, nbytes in ops:
        before = (budget.used, dict(budget.by_item))
        try:
            getattr(budget, op)(item, nbytes)
        except (SpecMoEError, RuntimeError, ValueError):
            assert (budget.used, budget.by_item) == before  # a refused operation changes nothing
        assert 0 <= budget.used <= limit and budget.used == sum(budget.by_item.values())
        assert all(0 <= held <= limit for held in budget.by_item.values())
        seen_peak = max(seen_peak, budget.used)
        assert budget.peak == seen_peak


# --- sampling ----------------------------------------------------------------------------------

FINITE = st.floats(-1e4, 1e4, allow_nan=False)


@FUZZ
@given(st.lists(FINITE, min_size=2, max_size=16), st.floats(0, 1e6, exclude_min=True, allow_subnormal=True),
       st.floats(0, 1, exclude_min=True, allow_subnormal=True), st.integers(0, 20))
def test_sampling_probabilities_are_a_distribution_for_any_settings(logits, temperature, top_p, top_k):
    x = torch.tensor(logits)
    probs = target_probs(x, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4)
    # the most likely token keeps the most probability (up to float32 rounding: at a huge
    # temperature two close logits may round to the same probability)
    assert probs[torch.argmax(x)] >= probs.max() - 1e-6


@FUZZ
@given(st.lists(st.floats(-8, 8), min_size=2, max_size=16), st.floats(0.25, 4.0),
       st.one_of(st.just(1.0), st.floats(0.01, 1)), st.integers(0, 20))
def test_top_k_and_top_p_keep_only_the_tokens_they_allow(logits, temperature, top_p, top_k):
    """Checked against the definitions, in float64 from the logits as float32 holds them once
    shifted and scaled (where close logits become equal): top-k keeps the tokens at least the
    k-th largest (ties kept); top-p then keeps the most probable tokens until their mass
    reaches top_p, so a kept token has less than top_p of mass above it."""
    x = torch.tensor(logits)
    probs = target_probs(x, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    kept = [i for i, p in enumerate(probs.tolist()) if p > 0]
    scaled = ((x - x.max()) / max(temperature, torch.finfo(torch.float32).tiny)).tolist()
    allowed = set(range(len(logits)))
    if 0 < top_k < len(logits):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        allowed = {i for i in allowed if scaled[i] >= kth}
    z = sum(math.exp(scaled[i]) for i in allowed)
    p64 = {i: math.exp(scaled[i]) / z for i in allowed}
    for i in kept:
        assert i in allowed, f"token {i} is outside the top {top_k}"
        # tokens within float32's rounding of each other are ties, kept in either order
        above = sum(p for p in p64.values() if p > p64[i] * (1 + 1e-6))
        assert above < top_p + 1e-5, f"token {i} kept with {above:.6f} of mass above it (top_p {top_p})"
    assert any(p64[i] >= max(p64.values()) * (1 - 1e-6) for i in kept)  # a most probable token stays
