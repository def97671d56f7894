"""Megatron-Core dist checkpoints (torch_dist and zarr backends). Placeholder."""
