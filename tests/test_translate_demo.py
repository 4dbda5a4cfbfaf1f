"""The bundled translation model `specmoe-demo-translate` (NLLB-MoE layout, trained on
Debian's gettext catalogs): every offloading policy and SpecMoE at γ = 1, 5, 10 give the
resident model's tokens at batch 1 and 16; its languages come from its tokenizer; the
CLI and the server translate with them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from factories import run_cli

from specmoe import LLM, SamplingParams
from specmoe.base.errors import SpecMoEError
from specmoe.base.paths import TRANSLATE_MODEL_DIR

MODEL = "specmoe-demo-translate"
SOURCES = [json.loads(line)["prompt"] for line in
           (Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "translate_heldout.jsonl")
           .read_text().splitlines()[:16]]
PARAMS = SamplingParams(max_tokens=12, temperature=0)


@functools.lru_cache(maxsize=None)
def resident(batch: int):
    llm = LLM(MODEL, policy="resident", device="cpu", max_batch_size=batch)
    outs = llm.generate(SOURCES[:batch], PARAMS)
    return llm, [o.token_ids for o in outs], llm.last_stats["token_ids_sha256"]


def test_bundled_model_is_an_nllb_moe_of_16_experts_top2_under_40_mb():
    config = json.loads((TRANSLATE_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["NllbMoeForConditionalGeneration"] and config["num_experts"] == 16
    assert config["encoder_sparse_step"] and config["decoder_sparse_step"]
    assert (TRANSLATE_MODEL_DIR / "model.safetensors").stat().st_size <= 40e6


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("policy, options", [
    ("ondemand", {}), ("overlap", {}), ("caching", {}), ("host", {"offload": "host"}),
    ("specmoe", {"gamma": 1}), ("specmoe", {"gamma": 5}), ("specmoe", {"gamma": 10, "draft_quant": "none"}),
])
def test_policy_translates_as_the_resident_model(policy, options, batch):
    llm = LLM(MODEL, policy=policy, device="cpu", device_memory="30%", max_batch_size=batch,
              **{"offload": "disk", **options})
    llm.generate(SOURCES[:batch], PARAMS)
    stats = llm.last_stats
    llm.close()
    assert stats["token_ids_sha256"] == resident(batch)[2]
    assert stats["encoder_transfer_bytes"] > 0 and stats["decoder_transfer_bytes"] > 0


def test_default_languages_are_the_trained_direction():
    llm, want, _ = resident(1)
    explicit = llm.generate(SOURCES[:1], PARAMS, src_lang="eng_Latn", tgt_lang="fra_Latn")
    assert [o.token_ids for o in explicit] == want


def test_unknown_language_names_the_codes_the_model_has():
    llm = resident(1)[0]
    with pytest.raises(SpecMoEError, match="deu_Latn is not a language of this model.*eng_Latn, fra_Latn"):
        llm.generate(SOURCES[:1], PARAMS, tgt_lang="deu_Latn")


def test_cli_translates_with_language_flags(capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", MODEL, "--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn",
                           "--max-tokens", "12", "--json", SOURCES[0])
    assert code == 0
    assert json.loads(out)["outputs"][0]["token_ids"] == resident(1)[1][0]


def test_cli_unknown_language_is_one_line_and_status_2(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", MODEL, "--tgt-lang", "xx", SOURCES[0])
    assert code == 2 and err.strip().count("\n") == 0 and "--tgt-lang xx" in err


def test_server_completion_translates_with_language_fields():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serving import serve_in_process

    llm, want, _ = resident(1)
    with serve_in_process(llm.engine, MODEL) as url:
        body = {"model": MODEL, "prompt": SOURCES[0], "max_tokens": 12, "temperature": 0,
                "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        bad = httpx.post(f"{url}/v1/completions", json={**body, "tgt_lang": "xx"}, timeout=120)
    assert got["choices"][0]["text"] == llm.tokenizer.decode(want[0])
    assert bad.status_code == 400 and "--tgt-lang xx" in bad.json()["error"]["message"]
