"""Real model shapes (dummy weights, norm scales perturbed) with every fused layer kernel on, against the
same model in plain PyTorch (``CausalLM.with_kernels``): last-layer logits of a packed prefill must agree
within the dtype's tolerance, and a decode-shaped forward (``T`` one-token sequences, Triton attention
without a cache, no logits) is timed both ways, eagerly and replayed from a CUDA graph.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionMetadata, ForwardContext, TorchAttentionBackend, forward_context
from tokenmill.attention.backend import AttentionBackend
from tokenmill.benchmarks.kernels.timing import Timer
from tokenmill.benchmarks.report import markdown_table
from tokenmill.kernels.options import KernelOptions
from tokenmill.loading import load_model
from tokenmill.models import CausalLM
from tokenmill.models.layers.norm import RMSNorm

PRESETS = ("llama-3.2-1b", "qwen3-0.6b", "gemma-3-270m")
DTYPES = (torch.bfloat16, torch.float32)
PREFILL_LENS = (37, 1, 100)
DECODE_TOKENS = (1, 64)
MAX_MODEL_LEN = 4096
# Relative (Frobenius) logit difference allowed: float32 sums in another order, and their rounding.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
ALL_ON = KernelOptions(rms_norm=True, rotary=True, activation=True)
Timing = tuple[int, float, float, float | None, float | None]
NO_TIMING: Timing = (0, 0.0, 0.0, None, None)


@dataclass
class ModelRow:
    preset: str
    dtype: str
    status: str
    logit_difference: float
    argmax_agreement: float
    timings: list[Timing]  # (tokens, eager torch s, eager fused s, graph torch s, graph fused s)


def fused_model_rows(
    timer: Timer,
    device: torch.device,
    presets: Sequence[str] = PRESETS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    decode_tokens: Sequence[int] = DECODE_TOKENS,
) -> list[ModelRow]:
    rows = []
    for preset in presets:
        for dtype in dtypes:
            rows.append(_model_row(timer, device, preset, dtype, decode_tokens))
            row = rows[-1]
            print(f"  fused model {preset:14s} {row.dtype:9s} {row.status}", flush=True)
    return rows


def _model_row(
    timer: Timer, device: torch.device, preset: str, dtype: torch.dtype, decode_tokens: Sequence[int]
) -> ModelRow:
    model = load_model(
        preset, device=device, dtype=dtype, load_format="dummy", max_model_len=MAX_MODEL_LEN
    ).model
    _perturb_norms(model)
    plain = _prefill_logits(model, PREFILL_LENS)
    fused_model = model.with_kernels(ALL_ON)
    fused = _prefill_logits(fused_model, PREFILL_LENS)
    difference = float((fused - plain).norm() / plain.norm())
    agreement = float((fused.argmax(-1) == plain.argmax(-1)).float().mean())
    status = "ok" if difference <= TOLERANCE[dtype] else f"WRONG ({difference:.1e})"
    timings = []
    if status == "ok":
        timings = [_decode_timing(timer, model, fused_model, tokens) for tokens in decode_tokens]
    del model, fused_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ModelRow(preset, str(dtype).removeprefix("torch."), status, difference, agreement, timings)


@torch.no_grad()
def _perturb_norms(model: CausalLM) -> None:
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(1)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            mean = 0.0 if module.unit_offset else 1.0
            module.weight.normal_(mean, 0.1, generator=generator)


def _prefill_logits(model: CausalLM, lens: Sequence[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    metadata = AttentionMetadata.for_prefill(list(lens), device)
    with torch.inference_mode(), forward_context(ForwardContext(metadata, TorchAttentionBackend())):
        return model.compute_logits(model(input_ids, positions)).float()


def _decode_timing(timer: Timer, plain: CausalLM, fused: CausalLM, tokens: int) -> Timing:
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    forward = _decode_shaped_forward(plain, tokens, TritonAttentionBackend())
    eager_plain, graph_plain = timer(lambda: forward(plain)), timer.graphed(lambda: forward(plain))
    eager_fused, graph_fused = timer(lambda: forward(fused)), timer.graphed(lambda: forward(fused))
    return tokens, eager_plain, eager_fused, graph_plain, graph_fused


def _decode_shaped_forward(
    model: CausalLM, tokens: int, backend: AttentionBackend
) -> Callable[[CausalLM], object]:
    """A decode-shaped forward of ``model`` or a configured copy of it, on the same inputs."""
    device = next(model.parameters()).device
    input_ids = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    positions = torch.randint(0, MAX_MODEL_LEN, (tokens,), device=device)
    metadata = AttentionMetadata.for_prefill([1] * tokens, device)

    @torch.inference_mode()
    def forward(configured: CausalLM) -> torch.Tensor:
        with forward_context(ForwardContext(metadata, backend)):
            hidden: torch.Tensor = configured(input_ids, positions)
        return hidden

    return forward


def format_model_rows(rows: Sequence[ModelRow]) -> str:
    headers = ["model (dummy)", "dtype", "check", "logit diff", "argmax agree", "T", "eager torch us"]
    headers += ["eager fused us", "graph torch us", "graph fused us", "graph speedup"]
    lines = []
    for row in rows:
        head = [row.preset, row.dtype, row.status, f"{row.logit_difference:.1e}"]
        head.append(f"{row.argmax_agreement:.3f}")
        for tokens, eager_plain, eager_fused, graph_plain, graph_fused in row.timings or [NO_TIMING]:
            speedup = f"{graph_plain / graph_fused:.2f}x" if graph_plain and graph_fused else "-"
            eager = [_us(eager_plain), _us(eager_fused)]
            graph = [_us(graph_plain), _us(graph_fused), speedup]
            lines.append([*head, str(tokens) if tokens else "-", *eager, *graph])
    return markdown_table(headers, lines)


def _us(seconds: float | None) -> str:
    return "-" if not seconds else f"{seconds * 1e6:.1f}"
