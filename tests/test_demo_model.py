"""The shipped demo model: specmoe and transformers agree on it, and it works out of the box."""

import json

import pytest
import torch
from factories import run_cli

from specmoe import LLM, SamplingParams
from specmoe.base.paths import DEMO_MODEL_DIR

PROMPTS = [
    "The built-in function len returns",
    "To open a file for reading, use",
    ".. function:: sorted(iterable, *, key=None, reverse=False)\n\n   Return a new",
]


@pytest.fixture(scope="module")
def demo():
    return LLM(device="cpu", dtype="float32", max_batch_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model.generation_config.eos_token_id = None  # generate exactly n tokens, as ignore_eos does
    return model, tokenizer


def test_log_probabilities_match_transformers(demo, reference):
    model, tokenizer = reference
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert ids == [demo.tokenizer.encode(p) for p in PROMPTS]
    ours = demo.score(ids)
    for prompt_ids, logits in zip(ids, ours):
        with torch.no_grad():
            theirs = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
        assert (logits - theirs).abs().max().item() <= 1e-4


def test_greedy_continuations_match_transformers(demo, reference):
    model, tokenizer = reference
    outs = demo.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            theirs = model.generate(ids, do_sample=False, max_new_tokens=16)[0, ids.shape[1]:].tolist()
        assert out.token_ids == theirs


def test_generate_and_info_work_without_a_model_argument(capsys):
    code, stdout, err = run_cli(capsys, "generate", "The built-in function len returns", "--max-tokens", "16", "--json")
    assert code == 0, err
    out = json.loads(stdout)["outputs"][0]
    assert len(out["token_ids"]) >= 1 and out["text"].strip()
    code, stdout, err = run_cli(capsys, "info", "--json")
    data = json.loads(stdout)
    assert data["path"].endswith("demo") and data["experts_per_block"] >= 16 and data["moe_layers"] >= 6
