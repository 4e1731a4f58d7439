"""The runner's side of speculative decoding: a step's logits at every verified position to kept tokens.

A chunk with ``k`` draft tokens has ``k + 1`` logit rows: row ``i`` predicts the token after draft token
``i`` (row 0: after the last real token). Each row is sampled as a plain step would sample that position
if the drafts before it were the output so far: penalties count them, ``min_tokens`` counts them, a seeded
row's key counts them. Chunks without drafts in the same step are one row each, sampled alike.
"""

from collections.abc import Sequence

import torch

from tokenmill.outputs import RowLogprobs
from tokenmill.runner.sampler import Sampler, SamplingBatch, SamplingRow, gather_logprobs, takes_raw_argmax
from tokenmill.scheduler.output import ScheduledChunk
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.rejection import RowNoise, accept_drawn, accepted_prefixes, distributions, verify
from tokenmill.structured.bitmask import apply_token_bitmask
from tokenmill.structured.manager import StructuredOutputs


def verification_rows(seq: Seq, num_drafts: int) -> list[SamplingRow]:
    """The sampling rows of ``seq``'s last token and its ``num_drafts`` provisional tokens."""
    output = seq.output_token_ids
    drafts = seq.draft_tokens[:num_drafts]
    outputs = [output + drafts[:i] for i in range(num_drafts + 1)]  # the output before each row's token
    return [SamplingRow(seq.params, seq.prompt_id_array, out, seq.banned_token_ids(out)) for out in outputs]


def verify_step(
    chunks: Sequence[ScheduledChunk],
    logits: torch.Tensor,
    vocab_size: int,
    structured: StructuredOutputs | None,
    sampler: Sampler,
) -> dict[Seq, list[tuple[int, RowLogprobs | None]]]:
    """The tokens each sampled chunk keeps (``logits``: ``chunk.num_sampled_rows`` rows per chunk);
    ``sampler``: the plain steps' own, whose draws decide one-hot guesses."""
    seqs = [chunk.seq for chunk in chunks]
    if all(map(_keeps_raw_argmax, seqs)):  # greedy, nothing to edit: only the argmax is read back
        return _greedy_verification(chunks, logits.argmax(dim=-1).tolist())
    rows = [row for chunk in chunks for row in verification_rows(chunk.seq, chunk.num_draft_tokens)]
    counts = [chunk.num_sampled_rows for chunk in chunks]
    grammars = [seq.grammar for seq, count in zip(seqs, counts, strict=True) for _ in range(count)]
    bitmask = None
    if any(grammar is not None for grammar in grammars):
        if structured is None:
            raise ValueError("a sequence has a grammar but this runner was given no structured outputs")
        bitmask = structured.bitmask(grammars)
    device = logits.device
    batch = SamplingBatch.build(rows, vocab_size, device, bitmask)
    draft_ids, draft_probs = _draft_tensors(chunks, vocab_size, device)
    if draft_probs is None:  # one-hot guesses: each row's plain-step draw decides (rejection.py)
        drawn = sampler(logits, batch)
        tokens, accept = drawn.token_ids, accept_drawn(drawn.token_ids, draft_ids)
        logprobs = drawn.logprobs.to_rows(batch.num_logprobs) if drawn.logprobs is not None else []
    else:
        masked = logits.float() if bitmask is None else apply_token_bitmask(logits.float(), bitmask)
        seeded = batch.draw.seeded_rows if batch.draw is not None else []
        accept, tokens = verify(distributions(masked, batch), draft_ids, draft_probs, RowNoise(seeded))
        logprobs = _logprobs(masked, tokens, batch)
    emitted = accepted_prefixes(accept, tokens, counts)
    out: dict[Seq, list[tuple[int, RowLogprobs | None]]] = {}
    first = 0
    for seq, count, kept in zip(seqs, counts, emitted, strict=True):
        entries = logprobs[first : first + len(kept)] if logprobs else [None] * len(kept)
        wanted = seq.params.logprobs is not None
        out[seq] = [(token, entry if wanted else None) for token, entry in zip(kept, entries, strict=True)]
        first += count
    return out


def _keeps_raw_argmax(seq: Seq) -> bool:
    """Whether every row of ``seq``'s chunk takes the argmax of its unedited logits and reports no
    logprobs. Banned ids (EOS before ``min_tokens``; bad words make a row edited already) only shrink as
    the output grows: none now, none at the draft tokens' positions."""
    params = seq.params
    return (
        takes_raw_argmax(params)
        and params.logprobs is None
        and seq.grammar is None
        and not seq.banned_token_ids()
    )


def _greedy_verification(
    chunks: Sequence[ScheduledChunk], argmax: list[int]
) -> dict[Seq, list[tuple[int, RowLogprobs | None]]]:
    """What :func:`verify` decides for greedy rows with nothing to edit, from the logits' argmax alone:
    each chunk keeps its draft tokens while they equal the argmax, then the argmax of the first row that
    differs (or of its last row). One small read back, no other device work."""
    out: dict[Seq, list[tuple[int, RowLogprobs | None]]] = {}
    first = 0
    for chunk in chunks:
        drafts = chunk.seq.draft_tokens[: chunk.num_draft_tokens]
        kept: list[tuple[int, RowLogprobs | None]] = []
        for offset in range(chunk.num_sampled_rows):
            token = argmax[first + offset]
            kept.append((token, None))
            if offset == len(drafts) or drafts[offset] != token:
                break
        out[chunk.seq] = kept
        first += chunk.num_sampled_rows
    return out


def _draft_tensors(
    chunks: Sequence[ScheduledChunk], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's draft token (-1 on a chunk's last row) and, where a draft model gave them, the
    distributions the draft tokens came from (one-hot for the rows of chunks without)."""
    ids: list[int] = []
    for chunk in chunks:
        ids.extend(chunk.seq.draft_tokens[: chunk.num_draft_tokens])
        ids.append(-1)
    draft_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    if all(chunk.seq.draft_probs is None for chunk in chunks):
        return draft_ids, None
    probs = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
    row = 0
    for chunk in chunks:
        count = chunk.num_draft_tokens
        given = chunk.seq.draft_probs
        if count and given is not None:
            probs[row : row + count] = given[:count].to(device=device, dtype=torch.float32)
        elif count:
            probs[torch.arange(row, row + count, device=device), draft_ids[row : row + count]] = 1.0
        row += count + 1
    return draft_ids, probs


def _logprobs(masked: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[RowLogprobs]:
    """Every row's logprobs of the token it would emit (raw or grammar-masked logits, as a plain step
    reports them); empty when no row asked."""
    num_top = batch.max_num_logprobs
    if num_top is None:
        return []
    tensors = gather_logprobs(torch.log_softmax(masked, dim=-1), tokens, num_top)
    return tensors.to_rows(batch.num_logprobs)
