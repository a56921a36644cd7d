"""Tensor parallelism (20): the model sharded over ranks, and the ranks kept in lockstep."""
