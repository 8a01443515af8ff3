"""Shared building blocks of the model families: norms, rope, attention, MoE dispatch."""
