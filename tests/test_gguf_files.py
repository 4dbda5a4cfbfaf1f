"""How --model finds a GGUF model (a file, a directory holding one, a split model's first
shard), its tokenizer (the file's own vocabulary, or a tokenizer.json beside it), what
`specmoe info` says about it, and bad files: one clear error naming what and what to do."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from factories import random_prompts, run_cli  # noqa: E402
from gguf_factories import make_gguf  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.errors import SpecMoEError  # noqa: E402
from specmoe.base.paths import DEMO_MODEL_DIR  # noqa: E402
from specmoe.base.tokenizer import Tokenizer  # noqa: E402
from specmoe.kernels import blockdot  # noqa: E402
from specmoe.tools.gguf_convert import convert  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHAPE = dict(device="cpu", max_batch_size=3, max_model_len=32)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(Hugging Face dir, its Q8_0 GGUF file, the file's greedy token sha)."""
    hf, path = make_gguf(tmp_path_factory.mktemp("mixtral"), "mixtral", "Q8_0")
    llm = LLM(model=str(path), **SHAPE)
    llm.generate(random_prompts(3, min_len=3, max_len=9, seed=7), GREEDY)
    return hf, path, llm.last_stats["token_ids_sha256"]


def _sha(model) -> str:
    llm = LLM(model=str(model), **SHAPE)
    llm.generate(random_prompts(3, min_len=3, max_len=9, seed=7), GREEDY)
    return llm.last_stats["token_ids_sha256"]


def test_a_directory_holding_one_gguf_file_is_that_model(mixtral, tmp_path):
    _, path, sha = mixtral
    shutil.copy(path, tmp_path / path.name)
    assert _sha(tmp_path) == sha


def test_a_gguf_file_without_the_suffix_is_read_by_its_magic(mixtral, tmp_path):
    """Ollama keeps models as blobs named by their hash (~/.ollama/models/blobs/sha256-...)."""
    _, path, sha = mixtral
    blob = tmp_path / "sha256-0123abcd"
    shutil.copy(path, blob)
    assert _sha(blob) == sha


def test_a_directory_with_two_gguf_models_asks_for_the_file(mixtral, tmp_path):
    _, path, _ = mixtral
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(path, tmp_path / name)
    with pytest.raises(SpecMoEError, match=r"expected one GGUF model file, found a.gguf, b.gguf; pass --model FILE"):
        LLM(model=str(tmp_path), **SHAPE)


def test_a_split_model_read_from_its_first_shard_is_the_whole_model(mixtral, tmp_path):
    hf, _, sha = mixtral
    convert(hf, tmp_path / "model.gguf", "Q8_0", split_max_tensors=10)
    shards = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(shards) >= 2 and shards[0].name.endswith("-00001-of-%05d.gguf" % len(shards))
    assert _sha(shards[0]) == sha
    with pytest.raises(SpecMoEError, match="is shard 2 of a split GGUF model; pass the first shard"):
        LLM(model=str(shards[1]), **SHAPE)
    shards[-1].unlink()
    with pytest.raises(SpecMoEError, match=f"{shards[-1].name}: shard {len(shards)} of {len(shards)} .* is missing"):
        LLM(model=str(shards[0]), **SHAPE)


def test_a_truncated_file_is_one_clear_error(mixtral, tmp_path):
    _, path, _ = mixtral
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(SpecMoEError, match=r"cut.gguf: not a readable GGUF file, truncated or corrupt .*download it"):
        LLM(model=str(tmp_path / "cut.gguf"), **SHAPE)
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(SpecMoEError, match=r"header.gguf: not a readable GGUF file, truncated or corrupt"):
        LLM(model=str(tmp_path / "header.gguf"), **SHAPE)


def _tiny_file(path, arch: str, **fields):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_architecture_specmoe_does_not_run_is_named(tmp_path):
    path = _tiny_file(tmp_path / "m.gguf", "mamba", block_count=1)
    with pytest.raises(SpecMoEError, match=r"m.gguf: GGUF architecture 'mamba' is not supported; specmoe runs "):
        LLM(model=str(path), **SHAPE)


def test_a_dense_model_is_not_an_moe(tmp_path):
    path = _tiny_file(tmp_path / "dense.gguf", "llama", block_count=1)
    with pytest.raises(SpecMoEError, match="a dense llama model .no experts.; specmoe runs Mixture-of-Experts models"):
        LLM(model=str(path), **SHAPE)


def test_experts_in_a_type_nothing_here_can_dequantize_are_refused_by_name(mixtral, tmp_path):
    """Q8_K (llama.cpp's intermediate type, which no file should hold): neither specmoe nor
    the gguf package dequantizes it, and the engine says so before it runs."""
    hf, _, _ = mixtral
    path = convert(hf, tmp_path / "q8k.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path), "r+")  # relabel one expert tensor's type in place
    field = next(t.field for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    field.parts[4][0] = int(gguf.GGMLQuantizationType.Q8_K)  # same bytes, now a smaller tensor: still fits
    reader.data.flush()
    del reader
    with pytest.raises(SpecMoEError, match="Q8_K"):
        LLM(model=str(path), **SHAPE)


def test_the_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    code, out, err = run_cli(capsys, "generate", "--model", str(bad), "hello")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "bad.gguf: not a readable GGUF file" in err


def test_info_reports_the_encodings_and_bytes_per_expert_as_stored(mixtral, capsys):
    import json

    _, path, _ = mixtral
    code, out, _ = run_cli(capsys, "info", "--model", str(path), "--device-memory", "50%", "--json")
    info = json.loads(out)
    assert code == 0 and info["family"] == "mixtral" and info["gguf_architecture"] == "llama"
    assert info["quantization"]["experts gate"] == "Q8_0 x2" and info["quantization"]["norms"].startswith("F32")
    stored = info["expert_bytes_as_stored"]["Q8_0/Q8_0/Q8_0"]
    assert stored == 3 * 32 * (64 // 32) * 34  # gate, up: 32 rows of 64; down: 64 rows of 32, 34 bytes a block
    assert info["expert_bytes"] >= stored and info["experts_fit"] > 0 and "specmoe" in info["policies_fit"]


@pytest.mark.skipif(not blockdot.available(), reason="the block kernels did not build here")
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_info_names_the_kernels_the_engine_computes_the_experts_with(mixtral, dtype):
    """`specmoe info` says how the engine computes each expert encoding: as stored by default,
    dequantized per call under --dtype float32 (it once said the second for both)."""
    from specmoe.tools.info import model_info

    _, path, _ = mixtral
    info = model_info(str(path), dtype=dtype, device="cpu")
    engine = LLM(model=str(path), dtype=dtype, **SHAPE)
    want = {f"experts {key}": why for key, why in engine.engine.policy.format.kernels.items()}
    assert {k: v for k, v in info["fused_kernels"].items() if k.startswith("experts")} == want
    assert all(why.startswith("as stored" if dtype == "auto" else "dequantized per call") for why in want.values())
    engine.close()


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    """The bundled demo model as Q8_0 GGUF, its tokenizer written into the file (none beside it)."""
    return convert(DEMO_MODEL_DIR, tmp_path_factory.mktemp("demo") / "demo-Q8_0.gguf", "Q8_0")


def test_the_files_own_vocabulary_tokenizes_as_the_models_tokenizer(demo_gguf):
    text = "The built-in function len returns the number of items"
    llm = LLM(model=str(demo_gguf), **SHAPE)
    want = Tokenizer(DEMO_MODEL_DIR)
    assert llm.tokenizer.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
    out = llm.generate([text], GREEDY)[0]
    assert out.text == want.decode(list(out.token_ids))


def test_a_tokenizer_json_beside_the_file_takes_precedence(demo_gguf, tmp_path):
    from specmoe.base.paths import BUNDLED

    shutil.copy(demo_gguf, tmp_path / demo_gguf.name)
    other = BUNDLED["specmoe-demo-translate"]
    shutil.copy(other / "tokenizer.json", tmp_path / "tokenizer.json")
    llm = LLM(model=str(tmp_path / demo_gguf.name), **SHAPE)
    text = "Save changes to the document"
    assert llm.tokenizer.encode(text, add_special_tokens=False) == \
        Tokenizer(other).encode(text, add_special_tokens=False)


def test_the_benchmark_section_is_made_from_its_document():
    """benchmarks/gguf_models.py's document -> BENCHMARKS.md's GGUF tables: every figure is the document's."""
    from specmoe.bench.gguf_tables import gguf_models

    models = {"bf16": {"expert_format": "bf16", "expert_bytes": 196608, "perplexity": 33.5, "perplexity_tokens": 900},
              "Q4_K": {"expert_format": "Q4_K/Q5_0 (gguf)", "expert_bytes": 59392, "perplexity": 33.75,
                       "perplexity_tokens": 900, "file_bytes": 10 << 20}}
    records = [{"model": m, "policy": "caching", "batch_size": 16, "decode_tokens_per_s": tps,
                "transfer_bytes_per_token": mb * 1e6, "vs_ondemand_bf16": ratio}
               for m, tps, mb, ratio in [("bf16", 50.0, 4.0, 1.0), ("Q4_K", 61.25, 0.5, 1.225)]]
    config = {"policies": ["caching"], "dtype": "bfloat16", "gamma": 5, "max_tokens": 32, "batches": 2, "repeats": 3,
              "expert_fraction": 0.3}
    text = gguf_models({"config": config, "models": models, "records": records})
    assert "| Q4_K | Q4_K/Q5_0 (gguf) | 58.0 KiB | 10.0 MiB | 33.750 |" in text
    assert "| bf16 | bf16 | 192.0 KiB | – |" in text
    assert "| Q4_K | caching | 61.2 (×1.23), 0.500 MB |" in text


def test_bench_runs_on_a_gguf_file(mixtral, tmp_path):
    """`specmoe bench --model FILE.gguf`: every policy's output equal to ondemand's."""
    import json

    from specmoe.cli import main

    _, path, _ = mixtral
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n"
                               for p in random_prompts(2, min_len=3, max_len=8, seed=9)))
    out = tmp_path / "b.json"
    code = main(["bench", "--model", str(path), "--batch-sizes", "2", "--repeats", "1", "--max-tokens", "3",
                 "--anchors", "none", "--device-memory", "50%", "--policies", "ondemand,specmoe",
                 "--prompts-file", str(prompts), "--offload-dir", str(tmp_path), "--threads", "1", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())["records"]
    assert [r["policy"] for r in records] == ["ondemand", "specmoe"]
    doc = json.loads(out.read_text())
    assert "B=2: outputs compared with ondemand (resident did not run)" in doc["notes"]
    # without resident the grid's reference is ondemand; the key keeps its name
    assert [r["outputs_match_resident"] for r in records] == [True, True]


def test_the_disk_sections_ceiling_is_the_fastest_read_rate_over_specmoes_decode_bytes():
    """BENCHMARKS.md's gguf-disk ceiling: the run's fastest disk rate over SpecMoE's decode bytes
    per token, beside the speeds its goals ask; left out for a document without decode bytes."""
    from specmoe.bench.gguf_tables import _read_ceiling

    records = [{"policy": "ondemand", "batch_size": 16, "decode_tokens_per_s": 27.5, "disk_read_rate": 1.5e9},
               {"policy": "specmoe", "batch_size": 16, "decode_tokens_per_s": 48.0, "disk_read_rate": 1.2e9,
                "decode_transfer_bytes_per_token": 20e6},
               {"policy": "resident", "batch_size": 16, "decode_tokens_per_s": 150.0}]
    anchors = [{"anchor": "llama.cpp", "batch_size": 16, "decode_tokens_per_s": 73.2}]
    text = _read_ceiling({"records": records, "anchors": anchors}, 50)
    assert ("- B = 16: SpecMoE's decode steps read 20.0 MB per token; at the fastest rate the disk gave in this run "
            "(ondemand, 1.50 GB/s) that is at most 75.0 tok/s, against 48.0 measured; 3x ondemand is 82.5 and "
            "llama.cpp ran at 73.2 tok/s") in text
    assert "3x" not in _read_ceiling({"records": records, "anchors": anchors}, 30)  # 30 %: a 1x goal
    del records[1]["decode_transfer_bytes_per_token"]
    assert _read_ceiling({"records": records, "anchors": anchors}, 50) == ""
