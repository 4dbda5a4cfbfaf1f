"""llama.cpp's greedy batch decoding through llama-cpp-python, with nothing of specmoe's
compute imported: no torch. A process that runs only this (the bench's capped llama.cpp
run) holds what a llama.cpp user's process holds; torch alone would add about 0.13 GiB of
its own memory, a tenth of a 1.5 GB cap.

B sequences decoded together through llama.cpp's batch API (llama_decode over one batch
holding a token of every sequence, each sequence its own seq_id in one KV cache): at B = 1
one request after another, as a llama.cpp user runs it; at B > 1 as its `llama-batched`
example does.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np


@functools.lru_cache(maxsize=1)
def _quiet_log(lib):
    """llama.cpp's log callback that prints nothing, made once and kept for the process:
    llama.cpp keeps the pointer after a runner closes, and a later call that logs (the
    quantizer's, the next runner's) through a freed callback crashed the process in libffi."""
    return lib.llama_log_callback(lambda level, text, data: None)


def chunks(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


class LlamaBatch:
    """A GGUF file loaded by llama.cpp for greedy decoding of `batch_size` sequences at once.

    `repack=False` is how a file bigger than memory is run: llama.cpp's CPU backend otherwise
    copies Q4_K (and other) weights into repacked anonymous buffers at load, on AVX-512 by
    default, so the whole file is held in the process's own memory and mmap cannot page it.
    """

    def __init__(self, path: Path, prompts: list[list[int]], batch_size: int, max_tokens: int, threads: int,
                 mmap: bool = True, repack: bool = True):
        import llama_cpp

        self.lib = lib = llama_cpp
        lib.llama_log_set(_quiet_log(lib), None)
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.use_mmap = mmap
        mp.use_extra_bufts = repack
        self.model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        prefill = max(sum(len(p) for p in c) for c in chunks(prompts, batch_size))
        cp = lib.llama_context_default_params()
        cp.n_seq_max = batch_size
        cp.n_ctx = batch_size * (max(len(p) for p in prompts) + max_tokens + 1)
        cp.n_batch = cp.n_ubatch = max(512, prefill)
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True  # one cache for all sequences, as llama-batched uses it
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.batch = lib.llama_batch_init(cp.n_batch, 0, batch_size)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.prompts, self.batch_size, self.max_tokens = prompts, batch_size, max_tokens

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama.cpp's llama_decode failed (KV cache full?)")

    def _argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
        return int(np.argmax(logits))

    def generate(self, chunk: list[list[int]]) -> tuple[list[list[int]], list[float]]:
        """Greedy tokens of each sequence and the time each step's logits were read."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(chunk) for pos, t in enumerate(p)]
        self._decode(entries)
        last = [i for i, e in enumerate(entries) if e[3]]  # each sequence's last prompt position
        outputs: list[list[int]] = [[] for _ in chunk]
        times = []
        for step in range(self.max_tokens):
            for s, i in enumerate(last):
                outputs[s].append(self._argmax(i))
            times.append(time.perf_counter())
            if step + 1 < self.max_tokens:
                self._decode([(out[-1], len(p) + step, s, True) for s, (p, out) in enumerate(zip(chunk, outputs))])
                last = list(range(len(chunk)))
        return outputs, times

    def run(self) -> tuple[list[list[int]], list[float], float]:
        """Every prompt, `batch_size` at a time: (tokens, each chunk's seconds to its first
        token, decode seconds: from each chunk's first token to its last, summed)."""
        outputs, ttfts, decode_s = [], [], 0.0
        for chunk in chunks(self.prompts, self.batch_size):
            t0 = time.perf_counter()
            tokens, times = self.generate(chunk)
            outputs += tokens
            ttfts.append(times[0] - t0)
            decode_s += times[-1] - times[0]
        return outputs, ttfts, decode_s

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)
        self.ctx = self.model = None
