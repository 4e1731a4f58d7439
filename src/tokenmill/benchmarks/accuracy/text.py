"""The fixed text perplexity is measured on, and the prompts whose greedy continuations are compared.

The text: chapters 1 to 3 of Jane Austen's *Pride and Prejudice* (1813, public domain), as transcribed by
Project Gutenberg (EBook #1342, https://www.gutenberg.org/ebooks/1342), the body text only.
The prompts: the engine tests' reference prompts (``tests/test_engine.py``), which every scheduling
feature must continue exactly as the single-sequence greedy loop does.
"""

from pathlib import Path

TEXT_SOURCE = "Pride and Prejudice, chapters 1-3 (Jane Austen, 1813; Project Gutenberg EBook #1342)"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colours:",
    "1, 2, 3, 4,",
)


def evaluation_text() -> str:
    return (Path(__file__).parent / "pride_and_prejudice_1-3.txt").read_text(encoding="utf-8")
