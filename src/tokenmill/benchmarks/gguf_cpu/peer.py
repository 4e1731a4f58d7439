"""llama.cpp on the same GGUF file, through llama-cpp-python's C API bindings.

The high-level ``Llama`` object runs one sequence; its C API takes a batch of tokens each tagged with a
sequence id, which is how llama.cpp's own ``batched`` example decodes several sequences at once. Both
counts run here through that one path: the prompts prefilled in one ``llama_decode`` call, then one call
per step holding each sequence's last token, greedy (argmax of the returned logits), EOS ignored.
llama-cpp-python builds llama.cpp from source on install (minutes); it is not a tokenmill dependency.
"""

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DecodeRun:
    """One timed generation: ``prefill_s`` until every sequence has its first token, then ``decode_s``
    for the remaining ``new_tokens - 1`` steps."""

    engine: str
    sequences: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    tokens: tuple[tuple[int, ...], ...]

    @property
    def decode_tokens_per_s(self) -> float:
        return self.sequences * (self.new_tokens - 1) / self.decode_s

    @property
    def total_tokens_per_s(self) -> float:
        return self.sequences * self.new_tokens / (self.prefill_s + self.decode_s)


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "the peer needs llama-cpp-python (pip install llama-cpp-python; it compiles llama.cpp, "
            "3-20 minutes on 2 cores), or run with --no-peer"
        ) from None
    return llama_cpp


class LlamaCpp:
    """A llama.cpp model and context sized for ``sequences`` sequences of ``max_len`` tokens."""

    def __init__(self, path: Path, sequences: int, max_len: int, threads: int) -> None:
        self.lib = lib = _import_llama_cpp()
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        params = lib.llama_context_default_params()
        params.n_ctx = sequences * max_len
        params.n_batch = params.n_ubatch = max(512, sequences * max_len)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.batch = lib.llama_batch_init(params.n_batch, 0, sequences)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        ids = (self.lib.llama_token * (len(data) + 8))()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), ids, len(ids), False, False)
        return list(ids[:count])

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, index)
        view = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,))
        return int(view.argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        entries = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        start = time.perf_counter()
        self._decode(entries)
        last = np.cumsum([len(p) for p in prompts]) - 1
        outputs = [[self._argmax(int(i))] for i in last]
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for step in range(new_tokens - 1):
            self._decode([(out[-1], len(prompts[seq]) + step, seq, True) for seq, out in enumerate(outputs)])
            for seq, out in enumerate(outputs):
                out.append(self._argmax(seq))
        decode_s = time.perf_counter() - start
        return DecodeRun(
            "llama.cpp", len(prompts), new_tokens, prefill_s, decode_s, tuple(tuple(o) for o in outputs)
        )

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)
