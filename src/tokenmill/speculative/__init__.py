"""Speculative decoding: a proposer guesses the next tokens of decoding sequences, the model computes all
of them in one step, and a rejection sampler keeps exactly the model's output distribution.

Modules: ``proposer`` (the interface, and which sequences ask for guesses), ``guessing`` (which steps
verify guesses, and when a decode step may be started ahead), ``ngram`` (prompt lookup),
``draft_model`` (a smaller model with its own KV cache; imports the runner, so import it by name),
``rejection`` (the rejection sampler), ``verification`` (a step's logits to kept tokens).

The scheduler appends the guesses to a sequence as provisional tokens, so a verification step is one more
case of its rule (computed tokens catch up with tokens); ``Scheduler.update`` keeps the accepted ones.
"""
