"""Exploration for issue 16: do llguidance's tokenizer slices, tuned for bounded JSON strings, make the
64-row mask fill of `bench structured`'s constraint cheaper? A slice is a regex; tokens are sorted into
the first slice they match whole, and where the lexer's state admits a whole slice its tokens are allowed
at once instead of walked through the token trie. The default slices (string contents of 1-10, 1-30 and
any length) never apply inside a string with fewer than 10 characters left of its ``maxLength``: the
whole trie is walked there. Every variant must give the masks the default gives (checked).

64 rows under ``endless(NESTED)`` walk one fixed path of uniformly drawn allowed tokens; each variant's
fresh matchers fill the same states one row at a time.

    python scripts/experiments/structured_slices.py STEPS ws|nows
"""

import statistics, sys, time
import llguidance, numpy as np, torch
from tokenmill.benchmarks.structured.schemas import NESTED, endless
from tokenmill.structured.backend import Vocabulary
from tokenmill.structured.llguidance_backend import LLGuidanceBackend, _grammar_text
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.loading.source import resolve_source

ROWS, STEPS, VOCAB = 64, int(sys.argv[1]), 128256
WSFLEX = sys.argv[2] == "ws"
tok = resolve_source(None).tokenizer()
backend = LLGuidanceBackend(Vocabulary(tok.hf_tokenizer, VOCAB, (tok.eos_token_id,)))
base = backend.tokenizer
grammar = _grammar_text(
    StructuredOutputsParams(json=endless(NESTED), disable_any_whitespace=not WSFLEX).spec()
)
words = -(-VOCAB // 32)
S = '[^"\\\\\\x00-\\x1F\\x7F]'
WS = "[\\x20\\x0A\\x0D\\x09]+"
configs = {
    "default": None,
    "none": [],
    "fine": [WS] + [f"{S}{{1,{k}}}" for k in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 30)] + [f"{S}+"],
    "fine+az": [WS, "[a-z]{1,2}", "[a-z]{1,4}", "[a-z]{1,8}", "[0-9]{1,3}"]
    + [f"{S}{{1,{k}}}" for k in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 30)]
    + [f"{S}+"],
    "pow2": [WS] + [f"{S}{{1,{k}}}" for k in (2, 4, 8, 10, 16, 30)] + [f"{S}+"],
}
rng = np.random.default_rng(0)
ms = [llguidance.LLMatcher(base, grammar) for _ in range(ROWS)]
masks = torch.zeros(ROWS, words, dtype=torch.int32)
paths = [[] for _ in range(ROWS)]
for _ in range(STEPS):
    for i, m in enumerate(ms):
        m.unsafe_compute_mask_ptr(masks[i].data_ptr(), words * 4)
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
    for i, m in enumerate(ms):
        t = int(rng.choice(np.flatnonzero(bits[i])))
        assert m.consume_token(t)
        paths[i].append(t)
print("example:", tok.decode(paths[0])[:200])
ref = None
for name, sl in configs.items():
    t0 = time.perf_counter()
    tk = base if sl is None else base.with_slices(sl)
    build = time.perf_counter() - t0
    ms = [llguidance.LLMatcher(tk, grammar) for _ in range(ROWS)]
    out = []
    rows = []
    for step in range(STEPS):
        m2 = torch.zeros(ROWS, words, dtype=torch.int32)
        for i, m in enumerate(ms):
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(m2[i].data_ptr(), words * 4)
            rows.append(time.perf_counter() - t)
        out.append(m2)
        for i, m in enumerate(ms):
            m.consume_token(paths[i][step])
    allm = torch.stack(out)
    same = "ref" if ref is None else ("identical" if torch.equal(ref, allm) else "DIFFERENT")
    if ref is None:
        ref = allm
    r = sorted(rows)
    print(
        f"{name:8} build {build * 1e3:6.0f} ms  per step {sum(rows) / STEPS * 1e3:6.2f} ms  row median {r[len(r) // 2] * 1e6:5.0f} us p90 {r[int(len(r) * 0.9)] * 1e6:5.0f} max {r[-1] * 1e6:6.0f}  masks {same}",
        flush=True,
    )
