"""Megatron-core strategy adapters."""
