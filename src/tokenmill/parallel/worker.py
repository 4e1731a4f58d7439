"""A tensor-parallel worker process: joins the group, builds its shard of the model and its KV pool,
then runs every forward pass and logits computation rank 0 announces, until told to stop.

The worker decides nothing: rank 0's scheduler picks the tokens, KV slots and block tables, and the
worker runs the same model code over them on its shard (the model's all-reduces and all-gathers pair
its collectives with rank 0's).
"""

import dataclasses
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.attention import AttentionBackend, ForwardContext, KVCacheLayer, forward_context
from tokenmill.attention.selector import create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.distributed import destroy_tensor_parallel, init_tensor_parallel, kv_head_shard
from tokenmill.engine.hardware_defaults import Platform, kernel_options_for, resolve_config
from tokenmill.loading.loader import load_model_for
from tokenmill.models import CausalLM, ModelConfig
from tokenmill.parallel.step_broadcast import (
    Command,
    receive_header,
    receive_hidden,
    receive_step_arrays,
)
from tokenmill.runner.kv_cache import create_kv_cache
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
        model, backend, layers = _build_shard(spec.config, device)
        serve_steps(model, backend, layers, device)
    finally:
        destroy_tensor_parallel()


def _build_shard(
    config: EngineConfig, device: torch.device
) -> tuple[CausalLM, AttentionBackend, list[KVCacheLayer] | None]:
    """This rank's shard of the model and its KV pool, of the size rank 0 announces."""
    loaded = load_model_for(config, device)
    command, num_blocks, max_model_len = receive_header()[:3]
    if command != Command.SETUP:
        raise RuntimeError(f"expected rank 0's set-up message, got command {command}")
    resolved = resolve_config(config, Platform.detect(device), max_model_len)
    if num_blocks:  # 0: no pool (kv_cache none)
        resolved = resolved.with_options(num_kv_blocks=num_blocks)
    options = kernel_options_for(resolved, device)
    model: CausalLM = loaded.model.with_kernels(options)
    backend = create_attention_backend(resolved.kernels, device, options.pdl)
    dtype = next(model.parameters()).dtype
    kv_config = per_rank_model_config(loaded.config, dist.get_world_size())
    kv = create_kv_cache(resolved, kv_config, max_model_len, device, dtype)
    return model, backend, kv.layers


@torch.inference_mode()
def serve_steps(
    model: CausalLM, backend: AttentionBackend, layers: list[KVCacheLayer] | None, device: torch.device
) -> None:
    dtype = next(model.parameters()).dtype
    while True:
        header = receive_header()
        command = header[0]
        if command == Command.SHUTDOWN:
            return
        if command == Command.FORWARD:
            arrays = {
                name: to_device_async(array, device) for name, array in receive_step_arrays(header).items()
            }
            metadata = attention_metadata(arrays, header[1], header[2])
            with forward_context(ForwardContext(metadata, backend, layers)):
                model(arrays["input_ids"], arrays["positions"])
        elif command == Command.LOGITS:
            model.compute_logits(receive_hidden(header, dtype, device))
        else:
            raise RuntimeError(f"unknown command {command} from rank 0")
