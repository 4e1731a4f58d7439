"""A tensor-parallel worker process: joins the group, builds its shard of the model and its KV pool,
then runs every forward pass and logits computation rank 0 announces, until told to stop.

The worker decides nothing: rank 0's scheduler picks the tokens, KV slots and block tables, and the
worker runs the same model code over them on its shard (the model's all-reduces and all-gathers pair
its collectives with rank 0's). Where rank 0 runs steps through graph runners, the worker builds its own
from the same plan, captures with it (on a GPU), and replays the graph of each step's size, its overlapped
steps included: whether rank 0 then uses or drops such a step is rank 0's business alone.
"""

import dataclasses
import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tokenmill.attention import AttentionBackend, ForwardContext, forward_context
from tokenmill.attention.selector import create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.distributed import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    kv_head_shard,
    min_over_ranks,
    set_up_all_reduce,
)
from tokenmill.engine.hardware_defaults import Platform, kernel_options_for, resolve_config
from tokenmill.loading.loader import load_model_for
from tokenmill.models import CausalLM, ModelConfig
from tokenmill.parallel.step_broadcast import (
    Command,
    profile_done,
    receive_graph_plan,
    receive_header,
    receive_hidden,
    receive_step_arrays,
    receive_text,
    receive_token_ids,
)
from tokenmill.profiling import start_profiler, stop_profiler
from tokenmill.runner.graph_runners import GraphRunners, build_graph_runners, release_graphs
from tokenmill.runner.kv_cache import KVCache, create_kv_cache
from tokenmill.runner.memory_profile import profile_forward
from tokenmill.runner.step_inputs import attention_metadata, to_device_async

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled once, at spawn)."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    backend: str  # of the model's collectives: nccl or gloo
    device: str
    config: EngineConfig
    timeout_s: float  # of the model's collectives
    idle_timeout_s: float  # of the wait for rank 0's next step


def per_rank_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The model config as one rank's KV pool sees it: only the KV heads the rank holds."""
    local_kv, _ = kv_head_shard(config.num_kv_heads, world_size, 0)
    return dataclasses.replace(config, num_kv_heads=local_kv)


def run_worker(spec: WorkerSpec) -> None:
    """The spawned process's entry point."""
    torch.set_num_threads(1)  # the ranks share the host's cores with rank 0
    store = dist.TCPStore(
        spec.store_host,
        spec.store_port,
        spec.world_size,
        is_master=False,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    store.set(f"joined/{spec.rank}", "1")
    init_tensor_parallel(
        spec.backend,
        store,
        spec.rank,
        spec.world_size,
        timedelta(seconds=spec.timeout_s),
        timedelta(seconds=spec.idle_timeout_s),
    )
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        serve_steps(_build_shard(spec.config, device))
    finally:
        destroy_tensor_parallel()


@dataclasses.dataclass
class Shard:
    """One worker's part of the engine: its shard of the model, its KV pool, and the graph runners rank 0's
    plan asks for (none until it sends one)."""

    model: CausalLM
    backend: AttentionBackend
    kv: KVCache
    max_model_len: int
    device: torch.device
    graphs: GraphRunners = dataclasses.field(default_factory=GraphRunners)
    profiler: torch.profiler.profile | None = None  # while rank 0 profiles

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def _build_shard(config: EngineConfig, device: torch.device) -> Shard:
    """This rank's shard of the model and its KV pool, built in step with rank 0 (``build_runner``): the
    all-reduce path, then the pool, sized by profiling this GPU as rank 0 profiles its own (the
    profile's forward passes pair their collectives) and agreeing on the smallest count."""
    loaded = load_model_for(config, device)
    command, max_model_len = receive_header()[:2]
    if command != Command.SETUP:
        raise RuntimeError(f"expected rank 0's set-up message, got command {command}")
    resolved = resolve_config(config, Platform.detect(device), max_model_len, loaded.quantization)
    options = kernel_options_for(resolved, device)
    model: CausalLM = loaded.model.with_kernels(options)
    backend = create_attention_backend(resolved.kernels, device, options.pdl)
    dtype = next(model.parameters()).dtype
    set_up_all_reduce(resolved.custom_all_reduce, resolved.push_all_reduce, device, dtype, options.pdl)
    kv_config = per_rank_model_config(loaded.config, dist.get_world_size())
    profile = functools.partial(profile_forward, model, backend, None)
    agree = functools.partial(min_over_ranks, device=device)
    kv = create_kv_cache(resolved, kv_config, max_model_len, device, dtype, profile, agree)
    return Shard(model, backend, kv, max_model_len, device)


@torch.inference_mode()
def serve_steps(shard: Shard) -> None:
    """Run what rank 0 announces, in its order, until it says to stop."""
    while True:
        header = receive_header()
        command = header[0]
        if command == Command.SHUTDOWN:
            release_graphs(shard.graphs)  # before the group is left: see release_graphs
            return
        handler = _HANDLERS.get(command)
        if handler is None:
            raise RuntimeError(f"unknown command {command} from rank 0")
        handler(shard, header)


def _forward(shard: Shard, header: list[int]) -> None:
    received = receive_step_arrays(header)
    arrays = {name: to_device_async(array, shard.device) for name, array in received.items()}
    metadata = attention_metadata(arrays, header[1], header[2])
    with forward_context(ForwardContext(metadata, shard.backend, shard.kv.layers)):
        shard.model(arrays["input_ids"], arrays["positions"])


def _logits(shard: Shard, header: list[int]) -> None:
    shard.model.compute_logits(receive_hidden(header, shard.dtype, shard.device))


def _set_up_graphs(shard: Shard, header: list[int]) -> None:
    plan = receive_graph_plan(header, shard.device)
    shard.graphs = build_graph_runners(
        plan, shard.model, shard.backend, shard.kv, shard.max_model_len, argmax=_no_argmax
    )


def _no_argmax(logits: torch.Tensor) -> torch.Tensor:
    """A worker's graphs compute no argmax of the logits they gather: rank 0 alone picks the tokens."""
    return logits[..., :0]


def _decode_step(shard: Shard, header: list[int]) -> None:
    assert shard.graphs.decode is not None, "a decode graph step before rank 0's graph plan"
    shard.graphs.decode.run_arrays(_host_arrays(header), header[1])


def _start_next_step(shard: Shard, header: list[int]) -> None:
    """The overlapped step rank 0 started: its arrays, then the token ids it sampled, on the device."""
    assert shard.graphs.decode is not None, "a started step before rank 0's graph plan"
    arrays = _host_arrays(header)
    token_ids = receive_token_ids(header, shard.device)
    shard.graphs.decode.run_arrays(arrays, header[1], token_ids)


def _prefill_step(shard: Shard, header: list[int]) -> None:
    assert shard.graphs.prefill is not None, "a prefill graph step before rank 0's graph plan"
    shard.graphs.prefill.run_arrays(_host_arrays(header), header[1])


def _profile(shard: Shard, header: list[int]) -> None:
    directory = Path(receive_text(header))
    if header[1]:
        shard.profiler = start_profiler(shard.device)
    elif shard.profiler is not None:
        stop_profiler(shard.profiler, shard.device, directory, dist.get_rank())
        shard.profiler = None
    profile_done()


def _host_arrays(header: list[int]) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in receive_step_arrays(header).items()}


_HANDLERS: dict[int, Callable[[Shard, list[int]], None]] = {
    Command.FORWARD: _forward,
    Command.LOGITS: _logits,
    Command.GRAPHS: _set_up_graphs,
    Command.DECODE_GRAPH: _decode_step,
    Command.START_NEXT: _start_next_step,
    Command.PREFILL_GRAPH: _prefill_step,
    Command.PROFILE: _profile,
}
