"""When work runs: sequences, scheduling, the engine loop, sampling and run statistics."""
