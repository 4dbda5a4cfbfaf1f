"""Hardware profiles: built-ins load and validate, calibrated ones save and load by name."""

import json
from dataclasses import replace

import pytest

from specmoe.costmodel.hardware import HardwareProfile, builtin_profile_names, list_profiles, load_profile, save_profile

REQUIRED = {"h100-pcie5", "h100-80gb", "a100-40gb", "a100-80gb", "h200", "rtx-4090", "h100-pcie5-ssd"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))


def test_builtin_profiles_include_the_required_ones():
    assert REQUIRED <= set(builtin_profile_names())


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_builtin_profile_loads_with_source_and_positive_rates(name):
    p = load_profile(name)
    assert p.name == name and p.source and p.description
    assert p.fetch_bw > 0 and p.device_memory_bytes > 2**30


def test_paper_profile_is_pcie5_with_96_gib():
    p = load_profile("h100-pcie5")
    assert p.device_memory_bytes == 96 * 2**30
    assert 40e9 <= p.h2d_bw <= 64e9
    assert p.slow_tier == "host"


def test_ssd_profile_fetches_at_nvme_speed():
    p = load_profile("h100-pcie5-ssd")
    assert p.slow_tier == "disk"
    assert p.fetch_bw == pytest.approx(6e9)


def test_unknown_name_is_one_line_listing_valid_names():
    with pytest.raises(ValueError) as e:
        load_profile("h900")
    msg = str(e.value)
    assert "\n" not in msg and "h100-pcie5" in msg and "a100-40gb" in msg


def test_saved_profile_loads_by_name_and_path():
    p = replace(load_profile("a100-40gb"), name="mybox", source="measured")
    path = save_profile(p, measurements={"disk_read_bw": 1.6e9})
    assert load_profile("mybox") == p
    assert load_profile(str(path)) == p
    assert "mybox" in list_profiles()


def test_saving_under_a_builtin_name_is_refused():
    with pytest.raises(ValueError, match="built-in"):
        save_profile(load_profile("h200"))


def test_unknown_key_in_profile_file_is_named(tmp_path):
    d = load_profile("h200").to_dict()
    d["pcie_lanes"] = 16
    f = tmp_path / "x.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="pcie_lanes"):
        load_profile(str(f))


def test_nonpositive_rate_is_rejected():
    d = load_profile("h200").to_dict()
    d["h2d_bw"] = 0
    with pytest.raises(ValueError, match="h2d_bw"):
        HardwareProfile(**d)
