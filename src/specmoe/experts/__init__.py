"""Where expert bytes live and how they move: the offload store (host or disk tier), the
device pool and its slot table, the transfer engine, the device-memory ledger, the block
executor (a MoE block with experts that may be missing) and quantized copies."""
