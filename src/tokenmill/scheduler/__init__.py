"""Deciding: which tokens of which sequences run in the next forward pass."""
