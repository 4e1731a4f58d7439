"""Tensor parallelism: worker processes that run rank 0's steps on their shard of the model.

``launcher`` starts and stops the workers (rank 0's side), ``worker`` is a worker's loop, and
``step_broadcast`` is what travels each step: a fixed-size header, then the step's packed integer inputs
(for an eager forward pass or one through a graph runner), the token ids an overlapped step takes, or the
hidden rows whose logits rank 0 computes, as tensors.
"""
