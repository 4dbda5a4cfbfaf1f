"""The engine loop: admit requests, prefill them, decode the running batch, retire.

One `step()` either prefills newly admitted sequences or advances every running sequence
by one decode step (plain: one token; speculative: draft + verify, 1..gamma+1 tokens).
Requests may join and leave between steps (continuous batching).

Every forward pass runs in a pass scope opened on the policy (`policy.pass_scope(kind)`),
which hands back the ExpertBackend that runs the pass's MoE blocks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from ..base.checkpoint import Checkpoint
from ..base.gguf_checkpoint import load_tokenizer, open_checkpoint
from ..base.config import EngineConfig, expert_share
from ..base.errors import SpecMoEError, warn
from ..base.memory import anon_rss_bytes, release_free_memory
from ..experts.budget import DeviceBudget
from ..experts.formats import checkpoint_expert_dtype, expert_format
from ..kernels import blockdot
from ..kernels.cpu import usable_cores
from ..model.seq2seq import EncoderDecoderTransformer
from ..model.transformer import ModelWeights, MoETransformer
from ..policies import Runtime, make_policy, min_device_bytes
from .expert_load import ExpertLoad
from .gamma import MAX_GAMMA
from .host_memory import check_limit, check_tier, gamma_cap, limited_draft, measure_fixed, plan_limit
from .logprobs import token_logprobs
from .sampling import SamplingParams, sample_token, sample_tokens
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import SpeculativeDecoder
from .stats import RunCounters
from .tracing import StepTracer
from .translation import check_languages, translation_ids

MAX_PREFILL_TOKENS = 4096  # tokens per prefill forward: bounds activation memory
DEFAULT_MAX_MODEL_LEN = 2048


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SpecMoEError("device cuda requested but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, ckpt: Checkpoint, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    # On the CPU compute in float32: bf16 rounding differs with batch shapes, and greedy
    # outputs must not depend on which policy batched the work. On CUDA: the checkpoint's.
    return torch.float32 if device.type == "cpu" else ckpt.torch_dtype()


def draft_dense_dtype(options: EngineConfig, config, device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """bfloat16 for the draft's attention projections and LM head (ModelWeights.load keeps
    them so where the checkpoint stores them so), or None: the compute dtype. Only SpecMoE
    drafts, only float32 compute widens bfloat16 exactly and gains from it, and `auto`
    asks this CPU: with bfloat16 matrix units (AMX, AVX-512 BF16) the draft's projections
    ran about 3x faster than in float32; without them bfloat16 is slower."""
    if (options.draft_dense == "none" or options.policy != "specmoe" or dtype != torch.float32
            or config.attention.kind != "gqa" or config.seq2seq is not None):
        return None
    if options.draft_dense == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and bfloat16_pays(config.hidden_size, options.max_batch_size) else None


def bfloat16_pays(width: int, rows: int, ratio: float = 1.5) -> bool:
    """Whether a draft pass's [rows, width] x [width, width] product, float32 in and out,
    is at least `ratio` times faster through bfloat16 (both conversions included) on this
    CPU with this thread count than in float32 (measured at most 2048 wide: a few tens of
    milliseconds, and the ratio no longer changes with the width there)."""
    width = min(width, 2048)
    x, w = torch.randn(max(1, min(rows, 64)), width), torch.randn(width, width)
    w16 = w.to(torch.bfloat16)

    def fastest(product) -> float:
        times = []
        for _ in range(6):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        return min(times[1:])  # the first call warms the kernel up

    float32 = fastest(lambda: F.linear(x, w))
    return float32 >= ratio * fastest(lambda: F.linear(x.to(torch.bfloat16), w16).to(torch.float32))


def selected_rows(counts, every: list[bool]) -> list[int]:
    """Rows of a step's tokens (`counts` per sequence, in order): all of a sequence's rows
    where `every` says so, else only its last."""
    rows, start = [], 0
    for n, all_rows in zip(counts, every):
        rows.extend(range(start, start + n) if all_rows else [start + n - 1])
        start += n
    return rows


class Engine:
    """`choose(runtime) -> (options, description)` resolves `policy="auto"`: it is given
    the runtime a policy would be built with (autotune/choose.py; the API passes it in)."""

    def __init__(self, model_dir: str | Path, options: EngineConfig, choose=None):
        self.checkpoint = open_checkpoint(model_dir)  # a safetensors directory or a GGUF file
        self.config = self.checkpoint.config
        options.check_model(self.config)
        self.device = resolve_device(options.device)
        self.as_stored = blockdot.computes_as_stored(options.dtype, self.config, self.device)
        self.threads = None  # on a GPU: torch's setting is left alone
        if self.device.type == "cpu":
            # every core this process may use, as llama.cpp runs by default (kernels/cpu.py). A GGUF
            # model's matrices all go through the block kernels' threads; torch's own pool would only
            # spin beside them after each small operator (its OpenMP threads wait busily): the
            # real-size Q4_K model decoded 119 tok/s at B = 16 with torch on one thread, 86 on two.
            self.threads = options.threads or usable_cores()
            self.use_threads()
        self.dtype = resolve_dtype(options.dtype, self.checkpoint, self.device)
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.max_model_len = min(
            options.max_model_len or DEFAULT_MAX_MODEL_LEN, self.config.max_position_embeddings
        )
        # multiplied as stored, a bfloat16 checkpoint's matrices are bfloat16 in every pass already
        self.draft_dense = None if self.as_stored else draft_dense_dtype(options, self.config, self.device, self.dtype)
        # --memory-limit: what the process holds before any weight (interpreter, torch, tokenizer) is measured
        fixed = None if options.memory_limit is None else measure_fixed(self.device)
        self.host_fixed_bytes = anon_rss_bytes() if self.device.type == "cpu" else None  # own, before weights
        weights = ModelWeights.load(self.checkpoint, self.device, self.dtype, self.draft_dense, self.as_stored)
        # windowed layers keep a ring of their window plus the drafts a step may roll back
        rollback = max(options.gamma, MAX_GAMMA)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        kv_bytes = self.config.kv_elements_per_sequence(self.max_model_len, rollback) * elem * options.max_batch_size
        fmt = expert_format(self.config, self.dtype, self.device, checkpoint_expert_dtype(self.checkpoint),
                            blockdot.as_stored(options.dtype, self.device))  # as Runtime's
        slot_bytes = fmt.slot_bytes
        # the smallest budget this configuration runs in: every error about the budget names it
        minimum = weights.nbytes + kv_bytes + min_device_bytes(self.config, options, slot_bytes, self.device, self.dtype)
        device_memory = options.device_memory
        self.memory_plan = None
        if fixed is not None:
            self.memory_plan = plan_limit(options, self.config, fixed=fixed, elem=elem, max_model_len=self.max_model_len,
                                          prefill_tokens=MAX_PREFILL_TOKENS, stored_bytes=fmt.nbytes,
                                          converts=fmt.converts)
            check_limit(self.memory_plan, minimum)
            device_memory = self.memory_plan.budget
        self.budget = DeviceBudget(self._budget_bytes(device_memory, weights.nbytes, kv_bytes, slot_bytes), minimum)
        self.budget.reserve("non-expert weights", weights.nbytes)
        model_class = EncoderDecoderTransformer if self.config.seq2seq else MoETransformer
        self.model = model_class(self.config, weights, self.device, self.dtype, invariant=self.as_stored)
        self.cache = self.model.new_cache(options.max_batch_size, self.max_model_len, rollback=rollback)
        # The ledger holds the KV cache at its largest (every slot at max_model_len), so the
        # expert pool sized after it can never be squeezed by a growing cache.
        self.budget.reserve(
            "KV cache", kv_bytes,
            hint=f" ({options.max_batch_size} sequences x {self.max_model_len} positions; "
            "lower --batch-size (serve: --max-batch-size) or --max-model-len to need less)",
        )
        options = limited_draft(options, self.config)
        runtime = Runtime(self.config, self.checkpoint, self.device, self.dtype, self.budget, options, weights,
                          self.max_model_len)
        self.auto_plan = None
        tune_gamma = options.policy == "auto" or options.adapt_gamma
        asked = options.policy == "auto" or options.draft_memory == "auto"
        if asked and choose is None:
            raise SpecMoEError("auto settings are chosen by the LLM API; build the engine through specmoe.LLM")
        # the draft's split of a budget is planned by default too (where the API gives a planner)
        if choose is not None and (asked or options.plans_draft_split(self.budget.limits_above_minimum())):
            options, self.auto_plan = choose(runtime)
            runtime.options = options
        self.options = options
        self.policy = make_policy(runtime)
        if self.memory_plan is not None:
            check_tier(self.memory_plan, getattr(self.policy, "store", None))
        self.scheduler = Scheduler(options.max_batch_size)
        self.counters = RunCounters()
        self._next_id = 0
        self.tracer = StepTracer(options.trace, self) if options.trace else None
        # router picks per expert, counted only while the server's live view is watched
        self.expert_load: ExpertLoad | None = None
        # gamma follows measured acceptance and pass times unless fixed (under policy auto the plan gives the first)
        self.decoder = SpeculativeDecoder(self, options.gamma, tune=tune_gamma, max_gamma=self._gamma_cap(options)) \
            if self.policy.speculative else None
        release_free_memory()  # what building the weights, copies and tier freed, back to the system

    @property
    def max_pass_rows(self) -> int | None:
        """The most rows one pass computes (None: no bound): a memory limit bounds activations."""
        return self.memory_plan.max_rows if self.memory_plan else None

    def _gamma_cap(self, options: EngineConfig) -> int:
        """The largest gamma whose verification pass fits `max_pass_rows` at the full batch."""
        cap = gamma_cap(self.max_pass_rows, options.max_batch_size)
        if not options.adapt_gamma and options.gamma > cap:
            warn(f"--gamma {options.gamma} verifies {options.max_batch_size * (options.gamma + 1)} rows a step, more "
                 f"than --memory-limit leaves room for ({self.max_pass_rows}): drafting {cap} tokens a step")
        return cap

    def use_threads(self) -> None:
        """Compute on this engine's threads again (torch's pool and the block kernels' are per
        process: another engine or library built since may have set them otherwise)."""
        if self.threads is None:
            return
        torch.set_num_threads(1 if self.as_stored else self.threads)
        blockdot.set_threads(self.threads)

    @property
    def gamma(self) -> int | None:
        """Draft tokens per speculative step now (None without speculation)."""
        return self.decoder.gamma if self.decoder else None

    def _budget_bytes(self, device_memory, non_expert: int, kv: int, slot_bytes: int) -> int | None:
        """Absolute budgets pass through; '30%' is non-expert weights + KV cache + 30 % of the
        experts as the device holds them (`slot_bytes` each: a bfloat16 checkpoint's experts
        held as stored take half a float32 slot), so a share is the same number of experts in
        any encoding."""
        share = expert_share(device_memory)
        if share is None:
            return device_memory
        experts = slot_bytes * len(self.config.moe_layer_ids) * self.config.num_experts
        return int(non_expert + kv + share * experts)

    # --- requests ----------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise SpecMoEError("empty prompt: give at least one character or token id")
            if self.tokenizer is None:
                raise SpecMoEError(
                    f"{self.checkpoint.dir} has no tokenizer.json: pass prompts as token ids (prompt_token_ids)"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise SpecMoEError("a token-id prompt must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise SpecMoEError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if not ids:
            raise SpecMoEError("empty prompt: give at least one character or token id")
        return ids

    def request_ids(self, prompt, src_lang=None, tgt_lang=None) -> tuple[list[int] | None, list[int]]:
        """(source ids, prompt ids) of a request: an encoder-decoder model reads `prompt` as
        the source to translate from `src_lang` into `tgt_lang` and starts its decoder with
        the start and target-language tokens; a decoder-only model has no source."""
        check_languages(self.config, src_lang, tgt_lang)
        if not self.config.seq2seq:
            return None, self.encode(prompt)
        source, ids = translation_ids(self.config, self.tokenizer, prompt, src_lang, tgt_lang, self.encode)
        if len(source) > self.max_model_len:
            raise SpecMoEError(f"source of {len(source)} tokens does not fit the context of "
                               f"{self.max_model_len} positions: shorten the text")
        return source, ids

    def add_request(self, prompt, params: SamplingParams, src_lang=None, tgt_lang=None,
                    source_ids: list[int] | None = None) -> Sequence:
        """Queue a request (see `request_ids`); given `source_ids` (from `request_ids`),
        `prompt` is the prompt's ids as that returned them."""
        if source_ids is None:
            source_ids, ids = self.request_ids(prompt, src_lang, tgt_lang)
        else:
            ids = list(prompt)
        source = source_ids or []
        if len(ids) >= self.max_model_len:
            raise SpecMoEError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} positions: "
                "shorten the prompt" + (" or raise --max-model-len" if self.max_model_len < self.config.max_position_embeddings else "")
            )
        seq = Sequence(self._next_id, ids, params, source_ids=source)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: int) -> None:
        """Drop a request; a running one leaves (and frees its slot) after the current step."""
        self.scheduler.cancel(request_id)

    def abandon(self, seqs: list[Sequence]) -> None:
        """Drop `seqs` at once (a step failed under them): their slots are free for the next run."""
        for seq in seqs:
            self.scheduler.cancel(seq.request_id)
        for seq in self.scheduler.retire():
            self.cache.free(seq.slot)

    # --- the loop --------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it."""
        admitted = self.scheduler.admit(self.cache.free_slots)
        if admitted:
            for seq in admitted:
                seq.slot = self.cache.allocate()
            t0, moved = time.perf_counter(), self.policy.moved_bytes()
            self._prefill(admitted)
            self.counters.prefill_s += time.perf_counter() - t0
            self.counters.prefill_transfer_bytes += self.policy.moved_bytes() - moved
        else:
            # in slot order: slots are handed out lowest first, so a batch is usually a
            # contiguous run of slots and attention reads the KV cache in place
            running = sorted((s for s in self.scheduler.running if not s.finished), key=lambda s: s.slot)
            if running:
                t0 = time.perf_counter()
                produced = self.decoder.step(running) if self.decoder else self._decode(running)
                for seq in running:
                    seq.steps += 1
                self.counters.add_step(time.perf_counter() - t0, len(running), produced)
        done = self.scheduler.retire()
        for seq in done:
            self.cache.free(seq.slot)
            self._finalize_text(seq)
        return done

    @property
    def _prefill_rows(self) -> int:
        """Prompt tokens per prefill pass (a longer prompt alone)."""
        return MAX_PREFILL_TOKENS if self.max_pass_rows is None else min(MAX_PREFILL_TOKENS, self.max_pass_rows)

    def _prefill(self, seqs: list[Sequence]) -> None:
        chunks: list[list[Sequence]] = [[]]
        size = lambda s: len(s.prompt_ids) + len(s.source_ids)  # noqa: E731
        for seq in seqs:
            if chunks[-1] and sum(map(size, chunks[-1])) + size(seq) > self._prefill_rows:
                chunks.append([])
            chunks[-1].append(seq)
        with self.pass_scope("prefill") as experts:
            for chunk in chunks:
                if self.config.seq2seq:  # the encoder at admission: its blocks run once for the chunk's sources
                    self.model.encode([s.slot for s in chunk], [s.source_ids for s in chunk], self.cache, experts)
                # the LM head runs on every prompt position only for sequences that score their prompt
                scored = [s.params.prompt_logprobs is not None for s in chunk]
                logits = self.forward_logits(experts, [s.slot for s in chunk], [s.prompt_ids for s in chunk],
                                             rows=scored)
                sizes = [len(s.prompt_ids) if every else 1 for s, every in zip(chunk, scored)]
                for seq, rows in zip(chunk, torch.split(logits, sizes)):
                    if seq.params.prompt_logprobs is not None:
                        # row i predicts prompt token i + 1; the first prompt token has no prediction
                        seq.prompt_logprobs = [None] + token_logprobs(rows[:-1], seq.prompt_ids[1:],
                                                                      seq.params.prompt_logprobs)
                    if seq.remaining == 0:  # max_tokens=0: a scoring request ends with its prefill
                        seq.finish_reason = "length"
                    else:
                        self.append_tokens(seq, [sample_token(rows[-1], seq.params, seq.generator)], rows[-1:])

    def _decode(self, seqs: list[Sequence]) -> int:
        with self.pass_scope("decode") as experts:
            logits = self.forward_logits(experts, [s.slot for s in seqs], [[s.pending] for s in seqs])
        for seq, token, row in zip(seqs, sample_tokens(logits, seqs), logits):
            self.append_tokens(seq, [token], row[None])
        return len(seqs)

    @contextmanager
    def pass_scope(self, kind: str):
        """A pass on the policy (with --trace, recorded; while `expert_load` is set, its
        router picks counted): yields the ExpertBackend."""
        if self.tracer:
            self.tracer.open()
        with self.policy.pass_scope(kind) as experts:
            if self.expert_load is not None and kind != "draft":
                experts = self.expert_load.wrap(experts)
            yield self.tracer.wrap(kind, experts) if self.tracer else experts

    def forward_logits(self, experts, slots, token_lists, rows="last", draft: bool = False) -> torch.Tensor:
        """Feed each slot its new tokens through the model, MoE blocks run by `experts`
        (from `pass_scope`). Logits of each sequence's last token ('last': [B, V]), of every
        new token ('all': [T, V]), or, given one boolean per sequence, of every new token of
        the sequences marked True and the last token of the others, in order. `draft`: a draft
        pass, whose dense products may round (layers.linear)."""
        starts = [self.cache.lengths[slot] for slot in slots]
        batch = self.model.step_batch(slots, starts, [len(t) for t in token_lists], draft)
        tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=self.device)
        if self.tracer:
            self.tracer.begin()
        hidden = self.model.forward(tokens, batch, self.cache, experts)
        if self.tracer:
            self.tracer.end(len(slots), batch.num_tokens)
        if rows == "last":
            if batch.max_new > 1:  # (with one new token each, every row is a last one)
                hidden = hidden[batch.last_token_rows()]
        elif rows != "all":
            hidden = hidden[selected_rows(batch.counts, rows)]
        return self.model.logits(hidden, draft)

    # --- finishing -------------------------------------------------------------------------

    def append_tokens(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> int:
        """Append generated tokens in order until the sequence finishes; return how many.
        `logits` [len(tokens), V] are the full model's rows that predicted them (for `logprobs`)."""
        appended = 0
        for token in tokens:
            appended += 1
            if self.append_token(seq, token):
                break
        if seq.params.logprobs is not None:
            seq.logprobs.extend(token_logprobs(logits[:appended], tokens[:appended], seq.params.logprobs))
        return appended

    def append_token(self, seq: Sequence, token: int) -> bool:
        """Append a generated token; return True when the sequence has finished."""
        now = time.perf_counter()
        seq.output_ids.append(token)
        seq.first_token_s = seq.first_token_s or now
        seq.last_token_s = now
        params = seq.params
        if not params.ignore_eos and token in self.config.eos_token_ids:
            seq.finish_reason = "stop"
        elif params.stop and self.tokenizer and self._hit_stop(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.total_len >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finished

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids)
        return any(stop in text for stop in seq.params.stop)

    def _finalize_text(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(seq.output_ids)
        for stop in seq.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        seq.text = text

    def run_until_done(self, on_step=None) -> None:
        while self.scheduler.has_work:
            self.step()
            if on_step:
                on_step()

    def close(self) -> None:
        if self.tracer:
            self.tracer.close()
        self.policy.close()
