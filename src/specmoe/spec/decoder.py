"""One speculative step for the whole running batch: draft, verify, accept, roll back.

KV invariant (as in plain decoding): before and after a step, a sequence's cache holds
its prompt and all its generated tokens but the last (`pending`). Drafting writes
provisional K/V at positions L .. L+g-1 (L = cache length); verification rewrites
L .. L+g with the full model's K/V; the cache is then cut to L + accepted + 1.
"""

from __future__ import annotations

import time

import torch

from ..engine.sampling import target_probs
from .verify import accept_greedy, accept_sampled


class SpeculativeDecoder:
    def __init__(self, engine):
        self.engine = engine
        self.policy = engine.policy
        # under --policy auto, gamma follows the measured acceptance and step times
        self.tuner = GammaTuner(self.policy.gamma) if engine.options.policy == "auto" else None

    def draft_lengths(self, seqs) -> list[int]:
        """gamma, or fewer near max_tokens or the end of the context (never wasted)."""
        limit = self.engine.max_model_len
        return [max(0, min(self.policy.gamma, s.remaining - 1, limit - s.total_len)) for s in seqs]

    def step(self, seqs) -> int:
        engine, cache, counters = self.engine, self.engine.cache, self.engine.counters
        starts = [cache.lengths[s.slot] for s in seqs]
        lengths = self.draft_lengths(seqs)

        t0 = time.perf_counter()
        drafts, draft_probs = self._draft(seqs, lengths)
        for seq, start in zip(seqs, starts):
            cache.truncate(seq.slot, start)  # verification rewrites these positions
        t1 = time.perf_counter()

        self.policy.begin_pass("verify")
        fed = [[s.pending] + d for s, d in zip(seqs, drafts)]
        logits = engine.forward_logits([s.slot for s in seqs], fed, rows="all")
        self.policy.end_verify()
        produced = 0
        accepted_lengths = []
        for seq, start, draft, q, rows in zip(seqs, starts, drafts, draft_probs, torch.split(logits, [len(f) for f in fed])):
            if seq.params.greedy:
                targets = rows.argmax(-1).tolist()
                accepted, nxt = accept_greedy(draft, targets)
                counters.agreed += sum(d == t for d, t in zip(draft, targets))  # teacher-forced agreement
            else:
                p = target_probs(rows, seq.params).cpu()
                accepted, nxt = accept_sampled(draft, torch.stack(q) if q else p[:0], p, seq.generator)
            cache.truncate(seq.slot, start + accepted + 1)
            counters.drafted += len(draft)
            counters.accepted += accepted
            counters.rejected += accepted < len(draft)
            accepted_lengths.append(accepted)
            for token in draft[:accepted] + [nxt]:
                produced += 1
                if engine.append_token(seq, token):
                    break
        if engine.tracer:
            engine.tracer.flush(accepted_lengths)
        t2 = time.perf_counter()
        counters.draft_s += t1 - t0
        counters.verify_s += t2 - t1
        if self.tuner and max(lengths, default=0):
            rejected = sum(a < n for a, n in zip(accepted_lengths, lengths))
            self.policy.gamma = self.tuner.update(sum(accepted_lengths), rejected, (t1 - t0) / max(lengths), t2 - t1)
        return produced

    def _draft(self, seqs, lengths):
        """gamma autoregressive steps with the draft experts only."""
        engine = self.engine
        self.policy.begin_pass("draft")
        drafts = [[] for _ in seqs]
        probs = [[] for _ in seqs]
        current = [s.pending for s in seqs]
        for k in range(max(lengths, default=0)):
            active = [i for i, g in enumerate(lengths) if g > k]
            logits = engine.forward_logits([seqs[i].slot for i in active], [[current[i]] for i in active], rows="last")
            for i, row in zip(active, logits):
                seq = seqs[i]
                if seq.params.greedy:
                    token = int(row.argmax())
                else:
                    q = target_probs(row, seq.params).cpu()
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[i].append(q)
                drafts[i].append(token)
                current[i] = token
        self.policy.end_draft()
        return drafts, probs


class GammaTuner:
    """Picks gamma to maximise expected tokens per second of a speculative step.

    With per-token acceptance a, a step of gamma drafts yields (1 - a^(gamma+1)) / (1 - a)
    tokens and costs gamma * t_draft + t_verify(gamma). Verification moves the same
    experts whatever gamma is, but computes gamma + 1 positions per sequence; each extra
    one costs about what a draft pass does (same B positions), so
    t_verify(g) = fixed + (g + 1) t_draft, the fixed part measured at the gamma used.
    a is estimated as accepted / (accepted + rejected) (accepted/drafted would count the
    drafts after a rejection as failures and pull gamma down); estimates are
    exponential moving averages.
    """

    def __init__(self, gamma: int, max_gamma: int = 10, smoothing: float = 0.3):
        self.gamma, self.max_gamma, self.smoothing = gamma, max_gamma, smoothing
        self.acceptance = self.t_draft = self.t_fixed = None

    def _ema(self, old, new):
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def update(self, accepted: int, rejected: int, t_draft: float, t_verify: float) -> int:
        """accepted: draft tokens accepted in the step; rejected: sequences that rejected one."""
        self.acceptance = self._ema(self.acceptance, accepted / (accepted + rejected) if accepted + rejected else 1.0)
        self.t_draft = self._ema(self.t_draft, t_draft)
        self.t_fixed = self._ema(self.t_fixed, max(0.0, t_verify - (self.gamma + 1) * t_draft))
        a = min(self.acceptance, 0.99)

        def rate(g):
            return (1 - a ** (g + 1)) / (1 - a) / (g * self.t_draft + self.t_fixed + (g + 1) * self.t_draft)

        self.gamma = max(range(1, self.max_gamma + 1), key=rate)
        return self.gamma
