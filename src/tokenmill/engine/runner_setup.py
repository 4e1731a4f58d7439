"""Building the model runner of an engine: the model with its kernels bound, the attention backend and
sampler, the KV cache sized around their activations (per rank under tensor parallelism), and the graphs
the config asks for."""

import functools

import torch

from tokenmill.attention.selector import create_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.distributed import min_over_ranks, set_up_all_reduce
from tokenmill.engine.hardware_defaults import kernel_options_for
from tokenmill.kernels.options import KernelOptions, resolve_kernel_toggle
from tokenmill.loading import LoadedModel
from tokenmill.models import CausalLM
from tokenmill.models.config import ModelConfig
from tokenmill.parallel.engine_setup import per_rank_model_config
from tokenmill.parallel.launcher import WorkerGroup
from tokenmill.runner.cuda_graphs import cuda_graph_sizes
from tokenmill.runner.kv_cache import create_kv_cache
from tokenmill.runner.memory_profile import profile_forward
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.prefill_graphs import prefill_graph_sizes
from tokenmill.runner.sampler import Sampler
from tokenmill.structured.manager import StructuredOutputs


def build_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    model_config: ModelConfig,
    max_model_len: int,
    device: torch.device,
    structured: StructuredOutputs,
    workers: WorkerGroup | None,
) -> tuple[ModelRunner, KernelOptions]:
    """The runner over ``loaded`` for the resolved ``config``, and the kernel options it bound."""
    kernels = config.kernels
    options = kernel_options_for(config, device)
    model: CausalLM = loaded.model.with_kernels(options)
    backend = create_attention_backend(kernels, device, options.pdl)
    sampler = Sampler(fused=resolve_kernel_toggle("sampling", kernels.fused_sampling, device))
    dtype = next(model.parameters()).dtype
    profile = functools.partial(profile_forward, model, backend, sampler)
    if workers is None:
        kv_cache = create_kv_cache(config, model_config, max_model_len, device, dtype, profile)
    else:
        workers.sender.setup(max_model_len)  # each worker now does what this rank does, in step
        set_up_all_reduce(config.custom_all_reduce, config.push_all_reduce, device, dtype, options.pdl)
        rank_config = per_rank_model_config(model_config, workers.world_size)
        agree = functools.partial(min_over_ranks, device=device)
        kv_cache = create_kv_cache(config, rank_config, max_model_len, device, dtype, profile, agree)
    graphs = config.graphs
    runner = ModelRunner(
        model,
        backend,
        sampler,
        kv_cache,
        max_model_len,
        graph_sizes=cuda_graph_sizes(config, device),
        prefill_graph_sizes=prefill_graph_sizes(config, device, max_model_len),
        logits_in_graph=graphs.logits,
        # the engine starts no step ahead while a step may speculate (LLMEngine._can_start_next_step)
        overlap=bool(graphs.overlap_decode),
        structured=structured,
        mirror=workers.sender if workers is not None else None,
    )
    return runner, options
