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
        if self.tuner and max(lengths, default=0) == self.policy.gamma:  # a full step, not cut short
            self.policy.gamma = self.tuner.update(produced, t2 - t0)
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
    """Picks gamma by measuring: tokens per second of speculative steps at each gamma
    tried (exponential moving averages), moving to the better neighbour (gamma +- 1) and
    trying an untried neighbour once. How verification time grows with gamma depends on
    the machine (transfer-bound: barely; compute-bound on a CPU: with every position),
    so no formula for it is assumed.
    """

    def __init__(self, gamma: int, max_gamma: int = 10, smoothing: float = 0.5):
        self.gamma, self.max_gamma, self.smoothing = gamma, max_gamma, smoothing
        self.rate: dict[int, float] = {}  # gamma -> tokens per second of a step

    def update(self, tokens: int, seconds: float) -> int:
        """Record a step at the current gamma that produced `tokens` in `seconds`; return
        the gamma for the next step."""
        g = self.gamma
        r = tokens / max(seconds, 1e-9)
        self.rate[g] = r if g not in self.rate else (1 - self.smoothing) * self.rate[g] + self.smoothing * r
        near = [n for n in (g - 1, g + 1) if 1 <= n <= self.max_gamma]
        untried = [n for n in near if n not in self.rate]
        if untried and max(self.rate.values()) == self.rate[g]:
            self.gamma = untried[-1]  # explore upwards first: longer drafts are the point
        else:
            self.gamma = max([g] + [n for n in near if n in self.rate], key=self.rate.get)
        return self.gamma
