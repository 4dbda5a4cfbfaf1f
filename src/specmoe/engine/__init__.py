"""When work runs: the engine loop (admit, prefill, decode, retire), the scheduler and
sequences, sampling, the speculative step (draft, verify, accept, roll back), acceptance
(pure functions), gamma tuning, run statistics and traces."""
