"""One speculative step for the whole running batch: draft, verify, accept, roll back.

KV invariant (as in plain decoding): before and after a step, a sequence's cache holds
its prompt and all its generated tokens but the last (`pending`). Drafting writes
provisional K/V at positions L .. L+g-1 (L = cache length); verification rewrites
L .. L+g with the full model's K/V; the cache is then cut to L + accepted + 1.
"""

from __future__ import annotations

import itertools
import time

import torch

from ..base.config import MAX_GAMMA
from .acceptance import TorchCoins, accept_greedy, accept_sampled
from .gamma import GammaTuner, StepMeasure
from .sampling import target_probs


class SpeculativeDecoder:
    """Owns gamma: fixed, or (`tune`) chosen each step by a GammaTuner from measured
    acceptance and pass times, down to 0 (plain decoding) where speculation does not pay."""

    def __init__(self, engine, gamma: int, tune: bool = False, max_gamma: int = MAX_GAMMA):
        self.engine = engine
        self.gamma = self.first_gamma = min(gamma, max_gamma)  # max_gamma: what a memory limit leaves room for
        self.tuner = GammaTuner(self.gamma, max_gamma=max_gamma) if tune else None

    def draft_lengths(self, seqs, gamma: int) -> list[int]:
        """gamma, or fewer near max_tokens or the end of the context (never wasted)."""
        limit = self.engine.max_model_len
        return [max(0, min(gamma, s.remaining - 1, limit - s.total_len)) for s in seqs]

    def step(self, seqs) -> int:
        engine, cache, counters = self.engine, self.engine.cache, self.engine.counters
        starts = [cache.lengths[s.slot] for s in seqs]
        # a seeded sampled sequence's tokens depend on its drafts' lengths, and an adapted gamma
        # on timing: while one runs, every step drafts the configured gamma, so that its seed
        # gives the same tokens in any run and on any engine
        seeded = self.tuner is not None and any(s.params.seed is not None and not s.params.greedy for s in seqs)
        lengths = self.draft_lengths(seqs, self.first_gamma if seeded else self.gamma)

        t0 = time.perf_counter()
        drafts, draft_probs = self._draft(seqs, lengths)
        for seq, start in zip(seqs, starts):
            cache.truncate(seq.slot, start)  # verification rewrites these positions
        t1 = time.perf_counter()

        fed = [[s.pending] + d for s, d in zip(seqs, drafts)]
        with engine.pass_scope("verify") as experts:
            logits = engine.forward_logits(experts, [s.slot for s in seqs], fed, rows="all")
        produced = 0
        accepted_lengths = []
        sizes = [len(f) for f in fed]
        argmax = logits.argmax(-1).tolist()  # the target's choice at every verified position, in one call
        firsts = itertools.accumulate(sizes, initial=0)
        for seq, start, draft, q, rows, first in zip(seqs, starts, drafts, draft_probs, torch.split(logits, sizes), firsts):
            if seq.params.greedy:
                targets = argmax[first: first + len(draft) + 1]
                accepted, nxt = accept_greedy(draft, targets)
                counters.agreed += sum(d == t for d, t in zip(draft, targets))  # teacher-forced agreement
            else:
                p = target_probs(rows, seq.params).cpu()
                accepted, nxt = accept_sampled(draft, torch.stack(q) if q else p[:0], p, TorchCoins(seq.generator))
            cache.truncate(seq.slot, start + accepted + 1)
            counters.drafted += len(draft)
            counters.accepted += accepted
            counters.rejected += accepted < len(draft)
            seq.drafted += len(draft)
            seq.accepted += accepted
            accepted_lengths.append(accepted)
            # the verification rows, never the draft's, give the tokens' log-probabilities
            produced += engine.append_tokens(seq, draft[:accepted] + [nxt], rows)
        if engine.tracer:
            engine.tracer.flush(accepted_lengths)
        t2 = time.perf_counter()
        counters.draft_s += t1 - t0
        counters.verify_s += t2 - t1
        if self.tuner and not seeded:  # a step cut short near max_tokens counts at the length it drafted
            drafted = tuple(zip((len(d) for d in drafts), accepted_lengths))
            self.gamma = self.tuner.update(StepMeasure(max(lengths, default=0), drafted, t1 - t0, t2 - t1))
        return produced

    def _draft(self, seqs, lengths):
        """gamma autoregressive steps with the draft experts only (none at gamma 0: plain decoding)."""
        engine = self.engine
        drafts = [[] for _ in seqs]
        probs = [[] for _ in seqs]
        current = [s.pending for s in seqs]
        if max(lengths, default=0) == 0:
            return drafts, probs
        with engine.pass_scope("draft") as experts:
            for k in range(max(lengths, default=0)):
                active = [i for i, g in enumerate(lengths) if g > k]
                logits = engine.forward_logits(experts, [seqs[i].slot for i in active], [[current[i]] for i in active],
                                               draft=True)
                greedy = logits.argmax(-1).tolist()  # every row's, in one call
                for i, row, token in zip(active, logits, greedy):
                    seq = seqs[i]
                    if not seq.params.greedy:
                        q = target_probs(row, seq.params).cpu()
                        token = int(torch.multinomial(q, 1, generator=seq.generator))
                        probs[i].append(q)
                    drafts[i].append(token)
                    current[i] = token
        return drafts, probs
