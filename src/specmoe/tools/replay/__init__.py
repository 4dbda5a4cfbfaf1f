"""``specmoe replay``: execute a recorded engine trace at another model's expert size and
time it, per policy.

    specmoe replay --trace specmoe=run-b16.jsonl --trace ondemand=od-b16.jsonl \\
        --model-shape mixtral-8x7b --layers 2 --device cuda --offload host --hardware local

What runs. K MoE layers of the shape are built with random weights (the time of a copy
or a matmul does not depend on the values), every routed expert one contiguous buffer
[gate | up | down] in the engine's own offload store (:mod:`specmoe.experts.store`:
host memory, pinned on CUDA, or the disk tier) and a device pool
(:mod:`specmoe.experts.pool`) filled by the engine's transfer engine
(:mod:`specmoe.experts.transfer`: one reader thread, on CUDA a side stream and events).
Each step of the trace is then executed pass by pass and layer by layer: the experts a
layer's routing names are fetched as the policy would fetch them and each is computed on
as many tokens (random activations) as the trace says, through the engine's own block
executor (:class:`specmoe.experts.executor.BlockExecutor`: experts already on the device
are computed while the missing ones stream in). Step times are real: ``perf_counter``
around each step, after ``torch.cuda.synchronize`` on CUDA.

Mapping a trace onto the shape (stated in every output):

- layers: the trace's MoE layer of rank r (0 = first MoE layer) runs on replayed layer
  r mod K. Every trace layer keeps its own pool entries (draft set, hot set), only the
  host copies of the weights are shared, so K only bounds host memory. Per-layer time
  = step time / trace layers; the full model = per-layer time x the shape's MoE layers.
- experts: id e -> e mod E (E = the shape's experts per layer), token counts of merged
  ids added. The demo model's 16 experts thus fold pairwise onto Mixtral's 8.
- SwiGLU only: a shape with 2-matrix experts (fc1, fc2; NLLB) is run as SwiGLU with
  2/3 of its intermediate size: the same bytes and FLOPs per token.

Policies (each with its own pool: the fetch decisions are the replay's, not copied from
the trace's ``fetched`` field, which depends on the recording's --device-memory):

- ``ondemand``: a block's experts are fetched when it runs, every step, and dropped after
  it (pool: one block, E slots).
- ``overlap``: as ondemand, plus the next block's experts are prefetched while this one
  computes. Predictor: the *recorded* routing of the next block, i.e. perfect prediction
  (the paper's oracle Overlap; the engine's overlap predicts with the next router
  applied to the previous hidden state and is at best this fast). Pool: 2E slots.
- ``caching``: the hottest ``--cache-fraction`` of each block's experts (by the trace's
  prefill routing, as the engine profiles the prompts) stay resident; misses are fetched
  on demand into E more slots (LRU).
- ``specmoe``: per cycle, the recorded draft set (ids mapped) is made resident (refresh;
  normally moves nothing), the gamma draft passes compute with the draft set only (picks
  outside it go round-robin to draft experts: affinity needs real weights; never a
  fetch: the bytes the transfer engine moves during draft passes are reported as
  ``draft_transfer_bytes``), then the verify pass fetches the union of what it needs
  minus the draft set, prefetching in the order the drafts' own picks predict (as the
  engine does). Pool: N x trace layers + E slots.

Which routing. A trace holds one policy's run. Greedy non-speculative policies produce
the same tokens and so the same routing: a trace recorded with any of them at batch B
is exact decode routing for ondemand, overlap and caching at B. Without one, their
decode passes are derived from a specmoe trace: each verify pass over B x (gamma + 1)
positions becomes gamma + 1 decode passes of B positions, its recorded expert picks
dealt to them at random per layer (a trace keeps per-expert token counts, not which
position chose what): per-expert totals are exact, per-step distinct counts are an
approximation. specmoe itself needs a specmoe trace at B.

Predictions. For the same steps (the replayed routing and the replay's own fetch
counts) the cost model's rules give a predicted step time
(:mod:`specmoe.costmodel.cost_model`: per-expert roofline + launches, per-expert transfer
time, each policy's overlap rule); ``prediction_error`` = predicted / measured - 1. The
projection to a full model adds the cost model's non-expert compute (attention over
``--context-len`` cached positions, routers, LM head); the cost model's own end-to-end
estimate (routing model fitted to the trace, as ``specmoe simulate``) is reported next
to it.

Modules, each importing only the ones above it in this list:

- :mod:`.errors`: ReplayError (one line, exit code 2);
- :mod:`.sources`: reading the traces given with --trace;
- :mod:`.schedule`: a trace mapped onto the shape, as the steps each policy replays;
- :mod:`.weights`: the replayed shape, the memory check, the random experts and their store;
- :mod:`.run`: one policy's pool and rules executing a schedule's steps, timed;
- :mod:`.predict`: hardware profile and the cost model's predictions for the same steps;
- :mod:`.results`: one output record per policy and batch size, speedups, the table;
- :mod:`.command`: the subcommand: arguments, the run, the JSON document.
"""
