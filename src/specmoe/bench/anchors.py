"""Anchors: the systems users already run, measured in the same run on the same token ids.

- `transformers`: `AutoModelForCausalLM.generate`, every weight resident, the same compute
  dtype as specmoe, greedy, the same batches (left-padded, with an attention mask).
- `llama.cpp` (through `llama-cpp-python`; `make anchors` builds it): a float32 GGUF copy
  of the checkpoint (tools/gguf_export.py, Mixtral family), the same prompts as token ids,
  greedy by the argmax of its logits, the same number of threads as the engines, at
  batch 1 (one request after another; its batched API is not driven yet, so it is skipped
  at larger batch sizes). Its kernels add in their own order, so its tokens may differ
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

import numpy as np
import torch

from ..base.checkpoint import Checkpoint
from ..engine.stats import token_ids_sha256
from ..tools.gguf_export import cached_gguf
from .runners import Runner

ANCHORS = ("transformers", "llama.cpp")


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
    """Whether an anchor runs at this batch size (llama.cpp: batch 1 only, see above)."""
    return name != "llama.cpp" or batch_size == 1


def _chunks(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


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

    def __init__(self, model_dir, prompts: list[list[int]], batch_size: int, max_tokens: int, device, dtype):
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
        self.fields = {"version": transformers.__version__, "dtype": str(dtype).removeprefix("torch."),
                       "experts_implementation": impl}

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def run(self):
        from transformers import LogitsProcessorList

        torch = self.torch
        outputs, ttfts, decode_s = [], [], 0.0
        pad = self.gen.pad_token_id
        start = time.perf_counter()
        for chunk in _chunks(self.prompts, self.batch_size):
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
    """llama.cpp on the checkpoint's GGUF copy, one request at a time, greedy."""

    kind = "anchor"
    label = "llama.cpp"

    def __init__(self, model_dir, prompts: list[list[int]], max_tokens: int, threads: int, cache: Path):
        import llama_cpp

        ckpt = Checkpoint(Path(model_dir))
        path = cached_gguf(ckpt, cache)
        longest = max(len(p) for p in prompts)
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=longest + max_tokens + 1, n_batch=max(512, longest),
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.llama_cpp = llama_cpp
        self.prompts, self.max_tokens = prompts, max_tokens
        self.fields = {"version": llama_cpp.__version__, "dtype": "float32", "threads": threads, "gguf": path.name}

    def _generate(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """Greedy tokens and the time each one's logits were ready."""
        llm, vocab = self.llm, self.llm.n_vocab()
        llm.reset()
        tokens, times = [], []
        feed = prompt
        for _ in range(self.max_tokens):
            llm.eval(feed)  # without logits_all it keeps no copy: read the last position's logits in place
            logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            token = int(np.argmax(logits))
            times.append(time.perf_counter())
            tokens.append(token)
            feed = [token]
        return tokens, times

    def run(self):
        outputs, ttfts, decode_s = [], [], 0.0
        start = time.perf_counter()
        for prompt in self.prompts:
            t0 = time.perf_counter()
            tokens, times = self._generate(prompt)
            outputs.append(tokens)
            ttfts.append(times[0] - t0)
            decode_s += times[-1] - times[0]
        wall = time.perf_counter() - start
        return _record(self.label, 1, self.prompts, outputs, wall, ttfts, decode_s, dict(self.fields)), outputs

    def close(self):
        self.llm.close()
        self.llm = None
        gc.collect()
