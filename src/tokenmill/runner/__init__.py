"""Executing: one scheduled step through the model on the device, and its sampled tokens."""
