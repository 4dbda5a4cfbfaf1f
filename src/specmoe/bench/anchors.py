"""Anchors: the systems users already run, measured in the same run on the same token ids.

- `transformers`: `AutoModelForCausalLM.generate`, every weight resident, the same compute
  dtype as specmoe, greedy, the same batches (left-padded, with an attention mask).
- `llama.cpp` (through `llama-cpp-python`; `make anchors` builds it): a GGUF model's own
  file, or a float32 GGUF copy of a checkpoint directory (tools/gguf_export.py, Mixtral
  family), the same prompts as token ids,
  greedy by the argmax of its logits, the same number of threads as the engines, the same
  batch size (its batch API: B sequences in one KV cache, one llama_decode a step). Its kernels add in their own order, so its tokens may differ
  from ours after a near tie: the record says how many agree.

An anchor that is not installed is skipped with a one-line note. Decode tokens/s is
measured the way specmoe measures it: tokens after the first, divided by the time from the
first token to the last (timestamps taken as each step's logits are ready).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import time
from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..base.gguf_file import is_gguf, model_file
from ..engine.stats import token_ids_sha256
from ..tools.gguf_export import cached_gguf
from .llama_batch import LlamaBatch, chunks
from .runners import Runner

ANCHORS = ("transformers", "llama.cpp")
# Anchors whose tokens must be resident's exactly: transformers is the reference
# implementation. llama.cpp's kernels add in their own order (and batch differently), so a
# near tie may go the other way: its share of equal tokens is reported, not checked.
EXACT = ("transformers",)


def missing(name: str) -> str | None:
    """Why an anchor cannot run here (None: it can)."""
    if name == "transformers":
        if importlib.util.find_spec("transformers") is None:
            return "transformers anchor skipped: transformers is not installed (pip install transformers)"
        return None
    if name == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
            return ("llama.cpp anchor skipped: llama-cpp-python and gguf are not installed "
                    "(make anchors, or pip install 'specmoe[anchors]': it compiles llama.cpp)")
        return None
    raise ValueError(name)


def runs_at(name: str, batch_size: int) -> bool:
    """Whether an anchor runs at this batch size (every anchor runs at every one)."""
    return name in ANCHORS


def _record(label, batch_size, prompts, outputs, wall_s, ttfts, decode_s, extra) -> dict:
    """Statistics shaped like specmoe's. `ttfts`: per batch, seconds from the start to its
    first token; `decode_s`: summed seconds from each batch's first token to its last."""
    generated = sum(len(o) for o in outputs)
    decode_tokens = generated - len(outputs)
    steps = max(1, max(len(o) for o in outputs) - 1) * len(ttfts)
    return {
        "policy": label, "batch_size": batch_size, "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": generated,
        "wall_s": wall_s, "prefill_s": sum(ttfts), "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "tokens_per_s_end_to_end": generated / wall_s if wall_s else None,
        "ttft_s": sum(ttfts) / len(ttfts), "tbt_s": decode_s / steps,
        "steps": None, "tokens_per_step": 1.0, "acceptance_rate": None,
        "transfer_bytes": 0, "transfer_bytes_per_token": 0.0, "device_peak_bytes": None, "cache_hit_rate": None,
        "token_ids_sha256": token_ids_sha256(outputs), **extra,
    }


class _Clock:
    """A logits processor that only notes when each step's logits are ready: the first
    call ends the prefill (first token), the last one is the last token."""

    def __init__(self, sync):
        self.times: list[float] = []
        self.sync = sync

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


class TransformersRunner(Runner):
    kind = "anchor"
    label = "transformers"

    def __init__(self, model_dir, prompts: list[list[int]], batch_size: int, max_tokens: int, device, dtype,
                 threads: int):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.device = device
        self.prompts, self.batch_size, self.max_tokens = prompts, batch_size, max_tokens
        gen = copy.deepcopy(self.model.generation_config)
        gen.do_sample = False
        gen.eos_token_id = None  # ignore EOS: every system generates max_tokens tokens
        pad = self.model.config.pad_token_id
        gen.pad_token_id = 0 if pad is None else pad
        gen.max_new_tokens = max_tokens
        for name in ("temperature", "top_p", "top_k"):
            setattr(gen, name, None)
        self.gen = gen
        impl = getattr(self.model.config, "_experts_implementation", None)
        self.threads = threads  # torch's pool on the CPU, set at each run (an engine may have set it to 1)
        self.fields = {"version": transformers.__version__, "dtype": str(dtype).removeprefix("torch."),
                       "experts_implementation": impl, "threads": threads if device.type == "cpu" else None}

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def run(self):
        from transformers import LogitsProcessorList

        torch = self.torch
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        outputs, ttfts, decode_s = [], [], 0.0
        pad = self.gen.pad_token_id
        start = time.perf_counter()
        for chunk in chunks(self.prompts, self.batch_size):
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            clock = _Clock(self._sync)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.gen,
                                          logits_processor=LogitsProcessorList([clock]))
            outputs += out[:, width:].tolist()
            ttfts.append(clock.times[0] - t0)
            decode_s += clock.times[-1] - clock.times[0]
        wall = time.perf_counter() - start
        return _record(self.label, self.batch_size, self.prompts, outputs, wall, ttfts, decode_s, dict(self.fields)), outputs

    def close(self):
        self.model = None
        gc.collect()


class LlamaCppRunner(Runner):
    """llama.cpp on the checkpoint's GGUF copy, greedy, B sequences decoded together
    (llama_batch.py): at B = 1 one request after another, as a llama.cpp user runs it; at
    B > 1 as its `llama-batched` example does."""

    kind = "anchor"
    label = "llama.cpp"

    def __init__(self, model_dir, prompts: list[list[int]], batch_size: int, max_tokens: int, threads: int,
                 cache: Path):
        import llama_cpp

        # a GGUF model is the anchor's own file, as its users run it; a checkpoint directory its float32 copy
        gguf = is_gguf(Path(model_dir))
        path = model_file(Path(model_dir)) if gguf else cached_gguf(Checkpoint(Path(model_dir)), cache)
        self.llama = LlamaBatch(path, prompts, batch_size, max_tokens, threads)
        self.prompts, self.batch_size = prompts, batch_size
        self.fields = {"version": llama_cpp.__version__, "dtype": "as the file" if gguf else "float32",
                       "threads": threads, "gguf": path.name}

    def run(self):
        start = time.perf_counter()
        outputs, ttfts, decode_s = self.llama.run()
        wall = time.perf_counter() - start
        return (_record(self.label, self.batch_size, self.prompts, outputs, wall, ttfts, decode_s, dict(self.fields)),
                outputs)

    def close(self):
        self.llama.close()
        gc.collect()
