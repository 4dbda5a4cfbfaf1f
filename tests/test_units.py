"""One size/rate parser: the same text means the same bytes in every command."""

import json

import pytest

from specmoe.base.errors import SpecMoEError
from specmoe.base.units import format_bytes, format_size_at_least, parse_batch_sizes, parse_rate, parse_size
from specmoe.cli import main


@pytest.mark.parametrize("text, nbytes", [
    ("24G", 24 * 2**30), ("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("24 gib", 24 * 2**30),
    ("512M", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096), ("1KiB", 1024), ("2kB", 2000),
    ("1T", 2**40), (7, 7),
])
def test_sizes_read_binary_for_bare_letters_and_iec_and_decimal_for_si(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "abc", "1.5XB", "inf", "nanGB"])
def test_bad_sizes_are_one_line_errors(text):
    with pytest.raises(SpecMoEError, match="size|finite|at least one byte"):
        parse_size(text, "--device-memory")


def test_rates_are_sizes_per_second():
    assert parse_rate("200MB/s") == 200e6 and parse_rate("1GiB") == 2**30
    with pytest.raises(SpecMoEError, match="--offload-bandwidth"):
        parse_rate(0)


def test_formatted_sizes_parse_back():
    for n in (1536, 3 * 2**20, 24 * 2**30):
        text = format_bytes(n).replace(" ", "")
        assert parse_size(text) == n


def test_batch_size_lists_are_sorted_and_unique():
    assert parse_batch_sizes("16,1,4,16") == [1, 4, 16]
    with pytest.raises(SpecMoEError, match="positive integers"):
        parse_batch_sizes("1,x")


def test_simulate_info_and_generate_read_24G_as_the_same_bytes(capsys):
    assert main(["simulate", "--model-shape", "mixtral-8x7b", "--hardware", "h100-pcie5", "--batch-sizes", "1",
                 "--device-memory", "24G", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)["config"]["device_memory"]
    assert main(["info", "--device-memory", "24G", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["device_memory"]
    assert main(["generate", "The built-in function len", "--max-tokens", "2", "--device-memory", "24G",
                 "--device", "cpu", "--json"]) == 0
    generated = json.loads(capsys.readouterr().out)["stats"]["device_memory"]
    assert simulated == info == generated == 24 * 2**30


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 1_300_234, 1_300_235, 10 << 20, (999 << 20) + 1, 90 << 30,
                               353_152, 7_777_777_777])
def test_a_size_named_as_at_least_reads_back_at_least_and_one_step_less_reads_below(n):
    text = format_size_at_least(n)
    assert parse_size(text) >= n
    number, unit = text.split()
    decimals = len(number.partition(".")[2])
    less = float(number) - 10 ** -decimals
    assert less <= 0 or parse_size(f"{less:.{decimals}f} {unit}") < n
