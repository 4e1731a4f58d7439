"""Calibration for GPTQ: text to run through the float model, and each projection's ``H = X^T X`` over the
inputs it receives on that text.

The text is the model's own: a fixed set of short prompts, each continued by sampling from the float model
(temperature 1, seeded), so no dataset has to be at hand and the inputs are the kind the model produces;
the scored text of ``tokenmill bench accuracy`` is not among them.
"""

from collections.abc import Callable, Sequence

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.llm import LLM
from tokenmill.loading import LoadedModel
from tokenmill.models import CausalLM
from tokenmill.models.layers.linear import LinearBase
from tokenmill.reference import SingleSequenceRunner
from tokenmill.sampling_params import SamplingParams

CALIBRATION_PROMPTS = (
    "The history of",
    "def main():",
    "Dear friend,",
    "1. First,",
    "Question: What is",
    "The recipe calls for",
    "In the year",
    "import numpy as np",
)


def sampled_calibration(loaded: LoadedModel, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """About ``num_tokens`` tokens in sequences that start at :data:`CALIBRATION_PROMPTS` (token 0 without
    a tokenizer) and continue with what the model samples (temperature 1), batched through the engine; a
    sequence at most as long as the model's context (more of them, the prompts taken again, where the
    tokens would not fit in one per prompt)."""
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode(p) for p in CALIBRATION_PROMPTS] if tokenizer is not None else [[0]]
    limit = loaded.config.max_position_embeddings
    length = min(max(max(map(len, prompts)) + 1, num_tokens // len(prompts)), limit)
    count = max(len(prompts), -(-num_tokens // length))
    starts = [prompts[i % len(prompts)] for i in range(count)]
    blocks = count * (length // 16 + 2)  # a KV pool for these sequences only, not the free memory
    config = EngineConfig(model=loaded.source, device=str(loaded.device))
    options = {"max_model_len": length, "num_kv_blocks": blocks, "block_size": 16}
    engine = LLMEngine(config.with_options(**options), loaded)
    params = [
        SamplingParams(temperature=1.0, max_tokens=max(1, length - len(p)), ignore_eos=True, seed=seed + i)
        for i, p in enumerate(starts)
    ]
    llm = LLM(engine=engine)
    outputs = llm.generate([{"prompt_token_ids": p} for p in starts], params)
    return [p + list(out.outputs[0].token_ids) for p, out in zip(starts, outputs, strict=True)]


def projection_hessians(model: CausalLM, sequences: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Module name -> float32 ``X^T X`` ``[in, in]`` of every projection (the LM head aside), its inputs
    ``X`` gathered over ``sequences`` run through ``model`` one by one."""
    projections = {name: module for name, module in model.named_modules() if isinstance(module, LinearBase)}
    hessians: dict[str, torch.Tensor] = {}

    def gather(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            rows = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            product = rows.T @ rows
            hessians[name] = product if name not in hessians else hessians[name] + product

        return hook

    handles = [module.register_forward_pre_hook(gather(name)) for name, module in projections.items()]
    try:
        for sequence in sequences:
            SingleSequenceRunner(model, len(sequence)).hidden_states(list(sequence))
    finally:
        for handle in handles:
            handle.remove()
    silent = sorted(set(projections) - set(hessians))
    if silent:
        raise RuntimeError(f"calibration never reached the projections {silent[:4]}")
    return hessians
