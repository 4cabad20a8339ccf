"""Data parallelism: threefold's bucketed gradient buffer (with the distributed optimizer's
sharding), and the wrappers around PyTorch DDP / FSDP2."""
