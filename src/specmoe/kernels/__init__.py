"""Compute kernels below the model: what this CPU is and how many cores a run may use
(cpu.py), and products with weights kept in their GGUF block encoding (blockdot.py, its C
source blockdot.c, and packed.py's `PackedMatrix`, which the model multiplies like a
dense matrix). torch's own fused CPU kernels and their guard are experts/kernels.py."""
