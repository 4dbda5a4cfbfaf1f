"""What to compute: the MoE transformer, its router and expert dispatch, its KV cache."""
