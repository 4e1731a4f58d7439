"""Turning a scheduled step into one forward pass: packed inputs, attention metadata, logits, samples.

A step's integer inputs reach the device in one non-blocking copy from pinned memory, and nothing on
the way reads a device value back, except the sampled token ids at the end: the step's one sync, in
:meth:`PendingStep.result`. Between :meth:`ModelRunner.execute` and that read the engine may enqueue the
next decode step (:meth:`ModelRunner.start_next_step`), so the GPU computes it while the host reads and
processes this one. Decode steps run through CUDA graphs when they are captured
(:mod:`tokenmill.runner.cuda_graphs`).
"""

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from tokenmill.attention import AttentionBackend, ForwardContext, forward_context
from tokenmill.models import CausalLM
from tokenmill.outputs import RowLogprobs
from tokenmill.runner.cuda_graphs import CaptureReport, DecodeGraphRunner
from tokenmill.runner.graph_runners import (
    GraphMirror,
    GraphPlan,
    GraphRunners,
    build_graph_runners,
    release_graphs,
)
from tokenmill.runner.kv_cache import KVCache
from tokenmill.runner.prefill_graphs import PrefillGraphRunner
from tokenmill.runner.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingRow,
    compute_prompt_logprobs,
)
from tokenmill.runner.step_inputs import attention_metadata, build_step_arrays, pack_to_device
from tokenmill.scheduler.output import ScheduledChunk, StepResult
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.verification import verify_step
from tokenmill.structured.manager import StructuredOutputs


class StepMirror(GraphMirror, Protocol):
    """Tensor-parallel workers, told of rank 0's graph plan, and of each forward pass (eager or through a
    graph runner) and logits computation."""

    def forward(self, arrays: Mapping[str, np.ndarray], max_query_len: int, max_seq_len: int) -> None: ...

    def set_up_graphs(self, plan: GraphPlan) -> None: ...


class PendingStep:
    """A step whose tokens are sampled on the device but not read yet."""

    def __init__(
        self, chunks: Sequence[ScheduledChunk], sampled: SamplerOutput | None, result: StepResult
    ) -> None:
        self.chunks = chunks
        self.sampled = sampled
        self._result = result
        self._host_ids = _HostCopy(sampled.token_ids) if sampled is not None else None

    @property
    def reads_only_token_ids(self) -> bool:
        """Whether reading the step needs nothing but its token ids (no logprobs)."""
        return self.sampled is not None and self.sampled.logprobs is None

    def result(self) -> StepResult:
        """Wait for the sampled token ids (the step's one sync) and hand back what the step produced."""
        if self.sampled is None or self._host_ids is None:
            return self._result
        token_ids = self._host_ids.tolist()
        logprobs: list[RowLogprobs | None] = [None] * len(self.chunks)
        if self.sampled.logprobs is not None:
            num_top = [chunk.seq.params.logprobs for chunk in self.chunks]
            logprobs = list(self.sampled.logprobs.to_rows(num_top))
        for chunk, token, entry in zip(self.chunks, token_ids, logprobs, strict=True):
            wanted = chunk.seq.params.logprobs is not None
            self._result.sampled[chunk.seq] = [(token, entry if wanted else None)]
        return self._result


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        sampler: Sampler,
        kv: KVCache,
        max_model_len: int,
        graph_sizes: Sequence[int] = (),
        logits_in_graph: bool = False,
        overlap: bool = False,
        structured: StructuredOutputs | None = None,
        prefill_graph_sizes: Sequence[int] = (),
        mirror: StepMirror | None = None,
    ) -> None:
        """``graph_sizes``: the decode batch sizes to capture in CUDA graphs (none: decode eagerly);
        ``logits_in_graph``: those graphs also compute the logits and their argmax (up to 16 rows);
        ``overlap``: a decode step's successor may be started before the step is read; ``structured``:
        the token masks of sequences with a grammar (needed once one is added); ``prefill_graph_sizes``:
        the token buckets of one-sequence prefill graphs (none: prefill eagerly); ``mirror``: tensor-parallel
        workers told of every forward pass and logits computation, to run theirs on their shards."""
        self.mirror = mirror
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.kv = kv
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.overlap = overlap
        self.structured = structured
        self.decode_graphs: DecodeGraphRunner | None = None
        self.graph_capture: CaptureReport | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        self.prefill_capture: CaptureReport | None = None
        prefill = tuple(prefill_graph_sizes) if kv.layers is not None else ()
        self.set_up_graphs(GraphPlan(tuple(graph_sizes), prefill, logits_in_graph))

    def set_up_graphs(self, plan: GraphPlan) -> None:
        """Run decode and one-sequence prefill steps through static buffers at the plan's sizes, captured as
        CUDA graphs on a GPU; tensor-parallel workers build theirs from the same plan and capture in
        lockstep (their collectives pair inside the graphs). Without a GPU nothing is captured and the
        static buffers run eagerly: how tests on CPU take these paths, under tensor parallelism too."""
        if not (plan.decode_sizes or plan.prefill_sizes):
            return
        if self.mirror is not None:
            self.mirror.set_up_graphs(plan)
        runners = build_graph_runners(
            plan, self.model, self.backend, self.kv, self.max_model_len, self.sampler.argmax, self.mirror
        )
        self.decode_graphs, self.graph_capture = runners.decode, runners.decode_capture
        self.prefill_graphs, self.prefill_capture = runners.prefill, runners.prefill_capture

    def release_graphs(self) -> None:
        """Free the captured graphs (before a tensor-parallel shutdown; no step runs after)."""
        release_graphs(GraphRunners(self.decode_graphs, self.prefill_graphs))
        self.decode_graphs = self.prefill_graphs = None

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> PendingStep:
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(chunks):
            logits, argmax = graphs.run(chunks)
            return PendingStep(chunks, self._sample(chunks, logits, argmax), StepResult())
        if graphs is not None:
            graphs.drop_started_step()
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(chunks):
            return self._prefill_from_graph(chunks[0])
        hidden, sample_rows = self._forward(chunks)
        sampled_chunks = [chunk for chunk in chunks if chunk.samples_next_token]
        result = StepResult(prompt_logprobs=self._prompt_logprobs(chunks, hidden))
        if not sampled_chunks:
            return PendingStep(sampled_chunks, None, result)
        logits = self._compute_logits(hidden[sample_rows])
        return self._sampled_step(sampled_chunks, logits, result)

    def _sampled_step(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor, result: StepResult
    ) -> PendingStep:
        """Sample each chunk's next token; where a chunk has draft tokens, verify them instead (all the
        step's chunks then go through the rejection sampler: one read of the results)."""
        if any(chunk.num_draft_tokens for chunk in chunks):
            result.sampled = verify_step(chunks, logits, self.vocab_size, self.structured, self.sampler)
            return PendingStep(chunks, None, result)
        return PendingStep(chunks, self._sample(chunks, logits), result)

    @torch.inference_mode()
    def logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """A forward pass over ``chunks`` and the logits of their sampled rows, valid until the next pass
        (a draft model's step: its proposer samples them itself). Through a decode graph or a one-sequence
        prefill graph where one runs the step, else eagerly."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(chunks):
            return graphs.run(chunks).logits
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(chunks):
            return self._compute_logits(self.prefill_graphs.run(chunks[0])[-1:])
        hidden, sample_rows = self._forward(chunks)
        return self._compute_logits(hidden[sample_rows])

    def _forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states of an eager step over ``chunks``, and the rows whose logits it needs."""
        arrays = build_step_arrays(chunks, self.kv.manager)
        dev = pack_to_device(arrays, self.device)
        max_query_len, max_seq_len = (
            max(chunk.num_tokens for chunk in chunks),
            max(chunk.end for chunk in chunks),
        )
        if self.mirror is not None:
            self.mirror.forward(arrays, max_query_len, max_seq_len)
        metadata = attention_metadata(dev, max_query_len, max_seq_len)
        with forward_context(ForwardContext(metadata, self.backend, self.kv.layers)):
            hidden = self.model(dev["input_ids"], dev["positions"])
        return hidden, dev["sample_rows"]

    def _prefill_from_graph(self, chunk: ScheduledChunk) -> PendingStep:
        assert self.prefill_graphs is not None
        hidden = self.prefill_graphs.run(chunk)
        if not chunk.samples_next_token:
            return PendingStep([], None, StepResult())
        logits = self._compute_logits(hidden[-chunk.num_sampled_rows :])  # with drafts: 1 + k rows
        return self._sampled_step([chunk], logits, StepResult())

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the full vocabulary (with workers, each computes its slice of them too)."""
        if self.mirror is not None:
            self.mirror.logits(hidden)
        return self.model.compute_logits(hidden)

    def can_start_next_step(self, step: PendingStep) -> bool:
        """Whether the decode step after ``step`` can be enqueued before ``step`` is read: ``step`` ran
        through a decode graph, reading it needs only its token ids, and overlap is on."""
        graphs = self.decode_graphs
        if not self.overlap or graphs is None:
            return False
        return step.reads_only_token_ids and graphs.can_run(step.chunks)

    def started_sequences(self) -> list[Seq] | None:
        """The sequences of the decode step started ahead and not run yet; None if there is none."""
        return self.decode_graphs.started_sequences() if self.decode_graphs is not None else None

    @torch.inference_mode()
    def start_next_step(self, step: PendingStep, rows: Sequence[int] | None = None) -> None:
        """Enqueue the decode step after ``step`` for its ``rows`` (default: all; the others end here), fed
        their sampled tokens on the device (the scheduler has reserved their KV slots); the next
        :meth:`execute` of exactly that step reuses it."""
        assert self.decode_graphs is not None and step.sampled is not None
        if rows is not None and len(rows) == len(step.chunks):
            rows = None
        self.decode_graphs.start_next_step(step.chunks, step.sampled.token_ids, rows)

    def _sample(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample each chunk's next token (``argmax``: the logits' argmax, when already computed). Rows
        with a grammar are masked by it: the step's bitmask is filled on the host now, while the device
        runs the forward pass enqueued before; a step without one runs no structured-output code."""
        seqs = [chunk.seq for chunk in chunks]
        outputs = [seq.output_token_ids for seq in seqs]
        rows = [
            SamplingRow(seq.params, seq.prompt_id_array, output, seq.banned_token_ids(output))
            for seq, output in zip(seqs, outputs, strict=True)
        ]
        grammars = [seq.grammar for seq in seqs]
        bitmask = None
        if any(grammar is not None for grammar in grammars):
            if self.structured is None:
                raise ValueError("a sequence has a grammar but this runner was given no structured outputs")
            bitmask = self.structured.bitmask(grammars)
        batch = SamplingBatch.build(rows, self.vocab_size, self.device, bitmask)
        return self.sampler(logits, batch, argmax)

    def _prompt_logprobs(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[Seq, list[RowLogprobs]]:
        """Logprobs of the prompt tokens this step's chunks predict, for sequences that asked for them. A
        sequence preempted mid-prompt recomputes positions whose logprobs it has already: only the positions
        after those are taken."""
        found: dict[Seq, list[RowLogprobs]] = {}
        row = 0
        for chunk in chunks:
            seq, num_top = chunk.seq, chunk.seq.params.prompt_logprobs
            first = seq.num_prompt_logprobs  # the first position whose logprob is still to come
            last_predicting = min(chunk.end, seq.num_prompt_tokens - 1)  # positions predicting a prompt token
            if num_top is not None and chunk.start <= first < last_predicting:
                skipped = row + first - chunk.start
                logits = self._compute_logits(hidden[skipped : row + last_predicting - chunk.start])
                targets = seq.prompt_token_ids[first : last_predicting + 1]
                found[seq] = compute_prompt_logprobs(logits, targets, num_top).to_rows(num_top)
            row += chunk.num_tokens
        return found


class _HostCopy:
    """A device tensor's values, copied to pinned host memory without blocking; :meth:`tolist` waits for
    that copy alone, not for work enqueued after it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        values: list[int] = self.host.tolist()
        return values
