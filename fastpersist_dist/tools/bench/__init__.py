"""Benchmark of FastPersist against megatron torch_dist."""
