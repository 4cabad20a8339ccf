"""Kernel selection: fused paths (Transformer Engine, apex, torch.compile, chunked
cross-entropy, SDPA backends) chosen once at start-up, each with an eager reference.

This package's `__init__` and `config` import no torch: flags are parsed before torch loads.
"""
