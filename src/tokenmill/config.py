"""``EngineConfig``: every optimization is a named toggle here, so its effect can be measured alone.

The settings are grouped by the part of the engine that reads them: the KV cache (``kv``), the scheduler
(``scheduler``), the kernels (``kernels``) and CUDA graphs (``graphs``). Each setting also has one flat
name, unique across groups, which is its command-line flag (``--max-num-seqs``) and its keyword in
``EngineConfig().with_options(max_num_seqs=8)`` and ``LLM(max_num_seqs=8)``: see :data:`FLAT_OPTIONS`.
"""

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from tokenmill.config_checks import (
    require,
    require_at_least_one,
    require_choice,
    require_consistent_groups,
    require_generation_config,
    require_types,
)
from tokenmill.config_speculative import SpeculativeConfig, speculative_options

KVCacheMode = Literal["none", "contiguous", "paged"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
BatchingMode = Literal["sequential", "static", "continuous"]
SchedulingPolicy = Literal["fcfs", "priority"]
AdmissionRule = Literal["fit", "headroom", "lookahead"]
AttentionBackendName = Literal["auto", "torch", "triton", "cpu"]
StructuredOutputBackendName = Literal["llguidance", "xgrammar"]
QuantizationMethod = Literal["auto", "none", "int8", "fp8", "gguf"]
GGUFActivations = Literal["float32", "int16", "int8"]  # what packed GGUF projections' inputs become
FUSED_KERNEL_TOGGLES: tuple[str, ...] = (
    "fused_rms_norm",
    "fused_rotary",
    "fused_activation",
    "fused_gemv",
    "fused_gemv_rows",
    "fused_w8a8",
    "fused_decode_rotary_kv",
    "fused_prefill_rotary_kv",
    "split_prefill_attention",
    "fused_sampling",
)


@dataclass(frozen=True)
class KVCacheConfig:
    """``mode``: ``none`` recomputes the whole sequence every step; ``contiguous`` reserves
    ``max_model_len`` slots per running sequence up front; ``paged`` takes ``block_size``-token blocks
    from a shared pool as sequences grow."""

    mode: KVCacheMode = "paged"
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from free memory
    gpu_memory_utilization: float = 0.9
    # KV budget on CPU, where free memory is not a safe guide; None: sized from the model, max_model_len and
    # max_num_seqs (see tokenmill.cache.kv_pool.default_cpu_kv_budget)
    cpu_kv_cache_gib: float | None = None
    # Reuse the KV blocks of prompt prefixes seen before (radix tree, LRU). None (auto): on with paged KV.
    prefix_caching: bool | None = None
    # What the pool stores K and V in (vLLM's kv_cache_dtype): "auto" the model's dtype; "fp8" (or
    # "fp8_e4m3") float8 e4m3 with a scale of 1, half the bytes of 16-bit K/V read by every decode step.
    kv_cache_dtype: KVCacheDtype = "auto"

    def __post_init__(self) -> None:
        require_types(self, _flat_names("kv"))
        require_choice("kv_cache", self.mode, ("none", "contiguous", "paged"))
        require_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", "fp8", "fp8_e4m3"))
        require(self.block_size >= 1, "block_size", "at least 1", self.block_size)
        require_at_least_one("num_kv_blocks", self.num_blocks)
        utilization = self.gpu_memory_utilization
        require(0 < utilization <= 1, "gpu_memory_utilization", "in (0, 1]", utilization)
        positive = self.cpu_kv_cache_gib is None or self.cpu_kv_cache_gib > 0
        require(positive, "cpu_kv_cache_gib", "positive (or None: sized)", self.cpu_kv_cache_gib)
        require(
            not (self.prefix_caching and self.mode != "paged"),
            "prefix_caching",
            "off unless kv_cache is 'paged' (cached prefixes are shared blocks)",
            self.prefix_caching,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """``batching``: ``sequential`` runs one request at a time; ``static`` admits a batch only when the
    previous one has fully finished; ``continuous`` admits and retires requests at every step.
    ``policy``: ``fcfs`` serves requests in arrival order; ``priority`` serves the lowest ``priority``
    value first (ties by arrival) and lets a waiting request preempt a worse running one.
    ``admission`` (paged KV): how many blocks admitting a request must leave free. ``fit`` admits whenever
    the new tokens fit (most concurrency; growth may preempt); ``headroom`` keeps the blocks every running
    request needs for ``admission_headroom`` of its remaining ``max_tokens``; ``lookahead`` keeps what the
    busiest future step needs, counting the blocks that requests finishing before it free, so no request
    with a known ``max_tokens`` is ever preempted."""

    batching: BatchingMode = "continuous"
    policy: SchedulingPolicy = "fcfs"
    max_num_seqs: int | None = None  # None: sized for the device (256 on a CUDA GPU, 64 on CPU)
    max_num_batched_tokens: int | None = None  # tokens per step; None: sized for the device (see above)
    # Split long prompts across steps, alongside running decodes. None (auto): on wherever a KV cache is.
    chunked_prefill: bool | None = None
    prefill_chunk_size: int | None = None  # cap on one request's prompt tokens per step (None: the budget)
    admission: AdmissionRule = "fit"
    admission_headroom: float = 0.0  # with admission="headroom": the share of remaining output kept free

    def __post_init__(self) -> None:
        require_types(self, _flat_names("scheduler"))
        require_choice("batching", self.batching, ("sequential", "static", "continuous"))
        require_choice("scheduling_policy", self.policy, ("fcfs", "priority"))
        require_choice("admission", self.admission, ("fit", "headroom", "lookahead"))
        require_at_least_one("max_num_seqs", self.max_num_seqs)
        require_at_least_one("max_num_batched_tokens", self.max_num_batched_tokens)
        require_at_least_one("prefill_chunk_size", self.prefill_chunk_size)
        require(0 <= self.admission_headroom <= 1, "admission_headroom", "in [0, 1]", self.admission_headroom)
        require(
            not (self.prefill_chunk_size and self.chunked_prefill is False),
            "prefill_chunk_size",
            "unset when chunked_prefill is off (it caps the chunks a prompt is split into)",
            self.prefill_chunk_size,
        )
        require(
            not (self.admission_headroom and self.admission != "headroom"),
            "admission_headroom",
            "0 unless admission is 'headroom' (the share applies to that rule only)",
            self.admission_headroom,
        )

    @property
    def max_running(self) -> int:
        """Sequences in flight at once: one for sequential batching. Read from a resolved config."""
        if self.batching == "sequential":
            return 1
        assert self.max_num_seqs is not None, "max_num_seqs is resolved when the engine starts"
        return self.max_num_seqs

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens`` of a resolved config."""
        assert self.max_num_batched_tokens is not None, "resolved when the engine starts"
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class KernelConfig:
    """Which implementation each layer binds. ``attention_backend`` ``auto`` and the ``fused_*`` toggles and
    ``programmatic_launch`` at None (auto): the Triton kernels with CUDA + Triton, PyTorch on CPU (with
    ``cpu`` attention where a C compiler is); False / ``torch`` = PyTorch; True / ``triton`` = the kernel,
    refused where it cannot run."""

    # "triton": paged Triton kernels; "cpu": decode steps through one C call a layer; "torch": reference
    attention_backend: AttentionBackendName = "auto"
    # float32 projections on CPU through oneDNN with each weight reordered once at start (another copy of
    # the weights in memory); other devices and dtypes keep F.linear. See models/layers/cpu_linear.py.
    prepacked_cpu_linear: bool = True
    # quantization "gguf": what a projection's inputs become before the products with the 4- / 8-bit
    # codes. "float32": times the exact float32 weights (the float32 engine's results up to summation
    # order: the default matches transformers, tests/test_gguf.py). "int16" / "int8" (AVX2 CPUs): rounded
    # per block of 32 and multiplied as integers (quantization/gguf_integer_kernel.py), faster: int16 keeps
    # SmolLM2's greedy tokens and top-1 but moves its logits by up to ~0.02 (beyond that test's 3e-4);
    # int8, llama.cpp's rounding, moves the top-1 token at 7% of positions.
    gguf_activations: GGUFActivations = "float32"
    # quantization "gguf": a decode step runs every plain Llama block (no biases, no q/k norms, SwiGLU) in
    # one C call over the same kernels (quantization/gguf_decode_blocks.py), not ~8 module and 5 ctypes
    # calls a block from Python; the same results bit for bit.
    gguf_decode_blocks: bool = True
    fused_rms_norm: bool | None = None  # RMSNorm with the residual add fused in (one launch)
    fused_rotary: bool | None = None  # rotary embedding of q and k in place (one launch)
    fused_activation: bool | None = None  # SwiGLU / GeGLU activation-and-multiply (one launch)
    # One-row projections (batch-1 decode) as Triton GEMVs, with the RMSNorm (and residual add) before
    # q/k/v and gate/up, and the gated activation before down_proj, fused into their loads; the LM head
    # too, writing float32 logits directly.
    fused_gemv: bool | None = None
    # Projections of 2-32 rows (small-batch decode, speculative verification) of small weights (below
    # kernels.options.GEMV_ROWS_MAX_WEIGHTS elements) through the GEMV on the tensor cores instead of
    # cuBLAS, launched programmatically dependent like the norm and activation kernels around them.
    fused_gemv_rows: bool | None = None
    # Quantized int8 / fp8 weights: projections of more than one row multiply 8-bit activations (quantized
    # per token in one launch) on the 8-bit tensor cores (torch._scaled_mm / torch._int_mm); off, the
    # weight is dequantized for F.linear (slow, but weight-only). One-row projections take fused_gemv.
    fused_w8a8: bool | None = None
    # Triton attention: decode steps rotate q and the new key and store the new K/V inside the decode
    # attention kernel (no rotary and KV-write launches per layer); prefill keeps the separate kernels.
    fused_decode_rotary_kv: bool | None = None
    # Triton attention: prefill steps (and speculative verification) rotate q and k and store the new K/V in
    # one launch per layer instead of a rotary and a KV-write launch.
    fused_prefill_rotary_kv: bool | None = None
    # Triton attention: prefill launches of at most 64 query tokens (speculative verification steps, short
    # chunks) cut each query tile's keys into partitions over more programs, merged by the last to finish
    # (decode's flash-decoding split), where a few programs would otherwise walk the whole context.
    split_prefill_attention: bool | None = None
    fused_sampling: bool | None = None  # temperature, top-k/min-p and the draw in one pass (Gumbel-max)
    # Hopper and later: launch the Triton kernels programmatically dependent, so each one starts (and
    # loads its weights) while the one before it finishes, and waits only for that one's results.
    programmatic_launch: bool | None = None

    def __post_init__(self) -> None:
        require_types(self, _flat_names("kernels"))
        require_choice("attention_backend", self.attention_backend, ("auto", "torch", "triton", "cpu"))
        require_choice("gguf_activations", self.gguf_activations, ("float32", "int16", "int8"))
        for name in (*FUSED_KERNEL_TOGGLES, "programmatic_launch"):
            value = getattr(self, name)
            require(value is None or isinstance(value, bool), name, "None (auto), True or False", value)
        require(
            not (self.fused_decode_rotary_kv and self.attention_backend in ("torch", "cpu")),
            "fused_decode_rotary_kv",
            f"off when attention_backend is {self.attention_backend!r} (part of the Triton decode kernel)",
            self.fused_decode_rotary_kv,
        )
        for name in ("fused_prefill_rotary_kv", "split_prefill_attention"):
            require(
                not (getattr(self, name) and self.attention_backend in ("torch", "cpu")),
                name,
                f"off when attention_backend is {self.attention_backend!r} (part of the Triton attention)",
                getattr(self, name),
            )


@dataclass(frozen=True)
class CudaGraphConfig:
    """Replay pure-decode steps from CUDA graphs (one per padded batch size); CUDA + triton attention only.
    None (auto): on where the Triton attention backend runs on a CUDA device; True elsewhere is ignored on
    CPU. Batches above the largest captured size, and prefill / mixed steps, run eagerly."""

    enabled: bool | None = None
    max_batch_size: int = 256  # capture sizes 1, 2, 4, 8, 16, 24, ... up to this (<= max_num_seqs)
    # The decode graphs of up to 16 rows also compute the logits (the LM head) and their argmax, which a
    # batch of greedy rows then takes as its tokens; off (and above 16 rows): they run after the replay.
    logits: bool = True
    # One sequence's prefill of up to 511 tokens also replays a graph (buckets of 16 ... 512 tokens): a
    # short prompt's time to first token is otherwise the host launching a few hundred kernels.
    prefill: bool = True
    # Start each decode step's successor on the GPU (fed the new tokens on the device) before the host
    # reads and processes them; used when the next step turns out to be exactly that. None (auto): on
    # wherever CUDA graphs are.
    overlap_decode: bool | None = None

    def __post_init__(self) -> None:
        require_types(self, _flat_names("graphs"))
        require(self.max_batch_size >= 1, "cuda_graph_max_batch_size", "at least 1", self.max_batch_size)
        require(
            not (self.overlap_decode and self.enabled is False),
            "overlap_decode",
            "off unless cuda_graphs is on (it overlaps graph replays)",
            self.overlap_decode,
        )


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads the model and serves requests; one frozen group per part of the engine."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    tokenizer: str | None = None  # None: the model's own; else another model's (e.g. for dummy weights)
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    load_format: str = "auto"  # "dummy": random weights of the named preset / config
    # Weights in 8 bits (tokenmill.quantization): int8 / fp8 quantize float weights per channel as they
    # load; "none" keeps them float (a pre-quantized checkpoint loads as published either way); "gguf"
    # keeps a .gguf file's blocks packed for the CPU kernel. "auto": gguf for a .gguf file loaded in
    # float32 on the CPU whose projections are all in formats the kernel reads, none otherwise.
    quantization: QuantizationMethod = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    debug_checks: bool = False  # check allocator + prefix-tree integrity after every step
    # Ranks each layer is split over (Megatron-style); rank 0 schedules, the others are worker processes.
    tensor_parallel_size: int = 1
    # Under tensor parallelism on GPUs: small all-reduces (decode steps) through symmetric memory, one
    # kernel reading every rank's buffer, instead of NCCL. None (auto): on where it can be set up.
    custom_all_reduce: bool | None = None
    # With custom_all_reduce: messages of up to 64 KiB (decode batches of a few rows) pushed into every
    # rank's buffer with no barrier (tokenmill.kernels.push_all_reduce). None (auto): on with it.
    push_all_reduce: bool | None = None
    # Before the first request, run synthetic ones through every kernel the engine can hit, so Triton
    # compiles them at start-up, not inside a request. None (auto): on where Triton kernels compile.
    warm_start: bool | None = None
    # torch's CPU threads in the engine's process. None (auto): 1 on a GPU unless OMP_NUM_THREADS is set
    # (the GPU does the math; idle OpenMP threads spinning at their barriers slow the host's own work,
    # llguidance's mask fill among it); torch's own default on CPU.
    host_threads: int | None = None
    # The grammar engine of structured outputs (JSON schema, regex, choice, grammar): llguidance, or
    # xgrammar (pip install 'tokenmill[xgrammar]'). Built at the first constrained request.
    structured_output_backend: StructuredOutputBackendName = "llguidance"
    # Fill the grammar masks of a step's constrained rows in the background as soon as the previous step's
    # tokens are known, off the host's critical path (tokenmill.structured.bitmask).
    structured_masks_ahead: bool = True
    # Default sampling parameters (tokenmill.generation_config): "auto" the model's generation_config.json,
    # "vllm" none, or a folder holding one; override_generation_config's fields go on top.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        require_types(self)
        require_at_least_one("max_model_len", self.max_model_len)
        require_choice("quantization", self.quantization, ("auto", "none", "int8", "fp8", "gguf"))
        require_at_least_one("tensor_parallel_size", self.tensor_parallel_size)
        if self.host_threads is not None:
            require_at_least_one("host_threads", self.host_threads)
        require_choice(
            "structured_output_backend", self.structured_output_backend, ("llguidance", "xgrammar")
        )
        require_generation_config(self.generation_config, self.override_generation_config)
        require_consistent_groups(self)

    def with_options(self, **options: Any) -> "EngineConfig":
        """A copy with settings changed by their flat names (see :data:`FLAT_OPTIONS`); a vLLM-style
        ``speculative_config`` dict stands for the speculative settings it names."""
        if "speculative_config" in options:
            options = {**options}
            options.update(speculative_options(options.pop("speculative_config")))
        unknown = sorted(set(options) - set(FLAT_OPTIONS))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(FLAT_OPTIONS)}")
        top = {name: value for name, value in options.items() if FLAT_OPTIONS[name][0] is None}
        groups: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            group, attribute = FLAT_OPTIONS[name]
            if group is not None:
                groups.setdefault(group, {})[attribute] = value
        changed = {group: replace(getattr(self, group), **values) for group, values in groups.items()}
        return replace(self, **top, **changed)

    def option(self, name: str) -> Any:
        """A setting by its flat name."""
        group, attribute = FLAT_OPTIONS[name]
        return getattr(self if group is None else getattr(self, group), attribute)

    def options(self) -> dict[str, Any]:
        """Every setting by its flat name: the config as one flat dict (for reports)."""
        return {name: self.option(name) for name in FLAT_OPTIONS}


# Every optimization off (PyTorch layers and attention, eager steps, no prompt splitting or prefix reuse):
# the reference the fast paths are checked against, and the bottom of the optimization ladder.
PLAIN_PATH: dict[str, Any] = {
    "attention_backend": "torch",
    **dict.fromkeys(FUSED_KERNEL_TOGGLES, False),
    "programmatic_launch": False,
    "cuda_graphs": False,
    "cuda_graph_logits": False,
    "cuda_graph_prefill": False,
    "overlap_decode": False,
    "chunked_prefill": False,
    "prefix_caching": False,
}

GROUPS: dict[str, type] = {
    "kv": KVCacheConfig,
    "scheduler": SchedulerConfig,
    "kernels": KernelConfig,
    "graphs": CudaGraphConfig,
    "speculative": SpeculativeConfig,
}
# Flat names whose group field is named differently (inside its group the prefix would repeat itself).
_ALIASES: dict[str, tuple[str, str]] = {
    "kv_cache": ("kv", "mode"),
    "num_kv_blocks": ("kv", "num_blocks"),
    "scheduling_policy": ("scheduler", "policy"),
    "cuda_graphs": ("graphs", "enabled"),
    "cuda_graph_max_batch_size": ("graphs", "max_batch_size"),
    "cuda_graph_logits": ("graphs", "logits"),
    "speculative_method": ("speculative", "method"),
    "speculative_model": ("speculative", "model"),
    "speculative_load_format": ("speculative", "load_format"),
    "speculative_disable_by_batch_size": ("speculative", "disable_by_batch_size"),
    "cuda_graph_prefill": ("graphs", "prefill"),
}


def _flat_names(group: str) -> dict[str, str]:
    """Field -> flat name, for the fields of ``group`` whose flat name differs."""
    return {field_name: flat for flat, (owner, field_name) in _ALIASES.items() if owner == group}


def _flat_options() -> dict[str, tuple[str | None, str]]:
    """Flat name -> (group attribute of EngineConfig or None, field name in it)."""
    flat: dict[str, tuple[str | None, str]] = {
        f.name: (None, f.name) for f in fields(EngineConfig) if f.name not in GROUPS
    }
    renamed = {target: name for name, target in _ALIASES.items()}
    for group, cls in GROUPS.items():
        for f in fields(cls):
            flat[renamed.get((group, f.name), f.name)] = (group, f.name)
    return flat


FLAT_OPTIONS: dict[str, tuple[str | None, str]] = _flat_options()
