"""Where experts live and how they move: the offload store, the device pool, transfers."""
