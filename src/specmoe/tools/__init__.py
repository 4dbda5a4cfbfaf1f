"""Commands beside generation: `info` (a model's bytes and what fits), `calibrate`
(measure this machine), `simulate` (the cost model across batch sizes) and `replay`
(time a recorded trace at another model's shape)."""
