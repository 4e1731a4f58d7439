"""Building a runner's graph runners (decode batches, one-sequence prefill) the same way on every rank.

Under tensor parallelism the model's all-reduces and all-gathers run inside the captured graphs, so every
rank must run the same warm-up passes and capture the same graphs in the same order: rank 0 announces
its :class:`GraphPlan` and each worker builds its runners from it with :func:`build_graph_runners`, as
rank 0 does. Without a CUDA device nothing is captured: the runners run eagerly over their static buffers
(how tests on CPU take these paths, workers included).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from tokenmill.attention import AttentionBackend
from tokenmill.models import CausalLM
from tokenmill.runner.cuda_graphs import CaptureReport, DecodeGraphRunner, DecodeMirror
from tokenmill.runner.kv_cache import KVCache
from tokenmill.runner.prefill_graphs import PrefillGraphRunner, PrefillMirror

logger = logging.getLogger(__name__)


class GraphPlan(NamedTuple):
    """What to run through static buffers: decode batch sizes, prefill token buckets (either may be
    empty), and whether the small decode graphs compute the logits too."""

    decode_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...] = ()
    logits_in_graph: bool = False


class GraphMirror(DecodeMirror, PrefillMirror, Protocol):
    """Tensor-parallel workers, told of every step rank 0 runs through its graph runners."""


@dataclass
class GraphRunners:
    decode: DecodeGraphRunner | None = None
    prefill: PrefillGraphRunner | None = None
    decode_capture: CaptureReport | None = None
    prefill_capture: CaptureReport | None = None


def build_graph_runners(
    plan: GraphPlan,
    model: CausalLM,
    backend: AttentionBackend,
    kv: KVCache,
    max_model_len: int,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    mirror: GraphMirror | None = None,
) -> GraphRunners:
    """The plan's runners over ``kv``'s pool, captured on a CUDA device: decode graphs, then prefill ones.
    ``mirror``: rank 0's workers, told of each step (a worker builds its own runners with none)."""
    if kv.layers is None:
        raise ValueError("decode and prefill graphs need a KV cache")
    runners = GraphRunners()
    if plan.decode_sizes:
        runners.decode = DecodeGraphRunner(
            model,
            backend,
            kv.layers,
            kv.manager,
            plan.decode_sizes,
            max_model_len,
            plan.logits_in_graph,
            argmax,
            mirror,
        )
    if plan.prefill_sizes:
        runners.prefill = PrefillGraphRunner(
            model, backend, kv.layers, kv.manager, plan.prefill_sizes, max_model_len, mirror
        )
    if kv.layers[0].key.device.type != "cuda":
        return runners
    if runners.decode is not None:
        runners.decode_capture = runners.decode.capture()
        logger.info(runners.decode_capture.describe())
    if runners.prefill is not None:
        runners.prefill_capture = runners.prefill.capture()
        logger.info(runners.prefill_capture.describe())
    return runners


def release_graphs(runners: GraphRunners) -> None:
    """Free every captured graph now. Under tensor parallelism each rank does so before it leaves its NCCL
    group: NCCL's teardown of a communicator blocks for good while a graph that captured its collectives
    is alive (pytorch/pytorch#115388; seen here on two H200s: every engine's shutdown hung)."""
    for runner in (runners.decode, runners.prefill):
        if runner is None:
            continue
        for graph in runner.graphs.values():
            graph.reset()
        runner.graphs.clear()
