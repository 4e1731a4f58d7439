"""Structured outputs: a request's text constrained to a JSON schema, a regex, a choice or a grammar.

Modules: ``params`` (what a request asks for: :class:`StructuredOutputsParams`), ``backend`` (the
grammar-backend interface), ``llguidance_backend`` (the default) and ``xgrammar_backend`` (optional),
``bitmask`` (host rows to device, applied to logits), ``manager`` (the engine's :class:`StructuredOutputs`:
compile cache and per-step masks). The engine keeps one matcher per constrained sequence
(``Sequence.grammar``), advances it with every sampled token and ends the sequence when its grammar
terminates; the runner asks for a step's bitmask only when some row has a matcher, and the sampler
masks those rows' logits before penalties, temperature and top-k / top-p / min-p.

Import from the modules: ``params`` is torch-free (``SamplingParams`` and the command line read it before
torch is imported), the others import torch.
"""
