"""``EngineConfig``: every optimization is a named toggle here, so its effect can be measured alone."""

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

KVCacheMode = Literal["none", "contiguous", "paged"]
BatchingMode = Literal["sequential", "static", "continuous"]
SchedulingPolicy = Literal["fcfs", "priority"]
KV_CACHE_MODES: tuple[str, ...] = ("none", "contiguous", "paged")
BATCHING_MODES: tuple[str, ...] = ("sequential", "static", "continuous")
ATTENTION_BACKENDS: tuple[str, ...] = ("torch", "triton")
FUSED_KERNEL_TOGGLES: tuple[str, ...] = (
    "fused_rms_norm",
    "fused_rotary",
    "fused_activation",
    "fused_gemv",
    "fused_decode_rotary_kv",
    "fused_sampling",
)
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads the model and serves requests.

    ``kv_cache``: ``none`` recomputes the whole sequence every step; ``contiguous`` reserves
    ``max_model_len`` slots per running sequence up front; ``paged`` takes ``block_size``-token blocks
    from a shared pool as sequences grow.
    ``batching``: ``sequential`` runs one request at a time; ``static`` admits a batch only when the
    previous one has fully finished; ``continuous`` admits and retires requests at every step.
    ``scheduling_policy``: ``fcfs`` serves requests in arrival order; ``priority`` serves the lowest
    ``priority`` value first (ties by arrival) and lets a waiting request preempt a worse running one.
    """

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    load_format: str = "auto"  # "dummy": random weights of the named preset / config
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    kv_cache: KVCacheMode = "paged"
    batching: BatchingMode = "continuous"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from free memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0  # KV budget on CPU, where free memory is not a safe guide
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = False  # split long prompts across steps, alongside running decodes
    prefix_caching: bool = False  # reuse the KV blocks of prompt prefixes seen before (radix tree, LRU)
    debug_checks: bool = False  # check allocator + prefix-tree integrity after every step
    prefill_chunk_size: int | None = None  # cap on one request's prompt tokens per step (None: the budget)
    attention_backend: str = "torch"  # "triton": paged Triton kernels (CUDA, or TRITON_INTERPRET=1)
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Paged KV: the share of every running request's remaining max_tokens whose blocks admission keeps
    # free, so requests admitted together can grow without preempting each other. 0 admits whenever the
    # new tokens fit (most concurrency; growth may preempt); 1 never preempts a request that has a known
    # max_tokens, but admits fewer when outputs end early.
    admission_headroom: float = 0.0
    # Paged KV: admit only if the pool holds every running request growing to its max_tokens at the busiest
    # future step, counting the blocks that requests finishing before it free. Like admission_headroom=1 it
    # never preempts a request with a known max_tokens, but it admits as many as the pool then allows.
    admission_lookahead: bool = False
    # float32 projections on CPU through oneDNN with each weight reordered once at start (another copy of
    # the weights in memory); other devices and dtypes keep F.linear. See models/layers/cpu_linear.py.
    prepacked_cpu_linear: bool = True
    # Fused Triton kernels, each alone: None (auto) = on with CUDA + Triton, off on CPU; False = PyTorch.
    fused_rms_norm: bool | None = None  # RMSNorm with the residual add fused in (one launch)
    fused_rotary: bool | None = None  # rotary embedding of q and k in place (one launch)
    fused_activation: bool | None = None  # SwiGLU / GeGLU activation-and-multiply (one launch)
    # One-row projections (batch-1 decode) as Triton GEMVs, with the RMSNorm (and residual
    # add) before q/k/v and gate/up, and the gated activation before down_proj, fused into their loads;
    # the LM head too, writing float32 logits directly.
    fused_gemv: bool | None = None
    # Triton attention: decode steps rotate q and the new key and store the new K/V inside the decode
    # attention kernel (no rotary and KV-write launches per layer); prefill keeps the separate kernels.
    fused_decode_rotary_kv: bool | None = None
    # Hopper and later: launch the Triton kernels programmatically dependent, so each one starts (and
    # loads its weights) while the one before it finishes, and waits only for that one's results.
    programmatic_launch: bool | None = None
    fused_sampling: bool | None = None  # temperature, top-k/min-p and the draw in one pass (Gumbel-max)
    # Replay pure-decode steps from CUDA graphs (one per padded batch size). CUDA + triton attention only;
    # ignored on CPU. Batches above the largest captured size, and prefill / mixed steps, run eagerly.
    cuda_graphs: bool = False
    cuda_graph_max_batch_size: int = 256  # capture sizes 1, 2, 4, 8, 16, 24, ... up to this (<= max_num_seqs)
    # With cuda_graphs: the decode graphs of up to 16 rows also compute the logits (the LM head) and their
    # argmax, which a batch of greedy rows then takes as its tokens; off (and above 16 rows): the LM head
    # and sampling run after the replay.
    cuda_graph_logits: bool = True
    # With cuda_graphs: start each decode step's successor on the GPU (fed the new tokens on the device)
    # before the host reads and processes them; used when the next step turns out to be exactly that.
    overlap_decode: bool = False

    def __post_init__(self) -> None:
        _require(self.kv_cache in KV_CACHE_MODES, "kv_cache", f"one of {KV_CACHE_MODES}", self.kv_cache)
        for name in (*FUSED_KERNEL_TOGGLES, "programmatic_launch"):
            value = getattr(self, name)
            _require(value is None or isinstance(value, bool), name, "None (auto), True or False", value)
        _require(self.batching in BATCHING_MODES, "batching", f"one of {BATCHING_MODES}", self.batching)
        _require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            "scheduling_policy",
            f"one of {SCHEDULING_POLICIES}",
            self.scheduling_policy,
        )
        _require(self.block_size >= 1, "block_size", "at least 1", self.block_size)
        _require(
            0 <= self.admission_headroom <= 1, "admission_headroom", "in [0, 1]", self.admission_headroom
        )
        _require(
            not (self.admission_lookahead and self.admission_headroom),
            "admission_lookahead",
            "off when admission_headroom is set (each is a rule for admission)",
            self.admission_lookahead,
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", "at least 1", self.max_num_seqs)
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "at least 1",
            self.max_num_batched_tokens,
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "in (0, 1]",
            self.gpu_memory_utilization,
        )
        _require(self.cpu_kv_cache_gib > 0, "cpu_kv_cache_gib", "positive", self.cpu_kv_cache_gib)
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            "at least 1",
            self.max_model_len,
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "num_kv_blocks",
            "at least 1",
            self.num_kv_blocks,
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"one of {ATTENTION_BACKENDS}",
            self.attention_backend,
        )
        _require(
            self.prefill_chunk_size is None or self.prefill_chunk_size >= 1,
            "prefill_chunk_size",
            "at least 1",
            self.prefill_chunk_size,
        )
        _require(
            not (self.prefix_caching and self.kv_cache != "paged"),
            "prefix_caching",
            "off unless kv_cache is 'paged' (cached prefixes are shared blocks)",
            self.prefix_caching,
        )
        _require(
            not (self.chunked_prefill and self.kv_cache == "none"),
            "chunked_prefill",
            "off when kv_cache is 'none' (a recomputed sequence has no cache to continue from)",
            self.chunked_prefill,
        )
        _require(
            not (self.fused_decode_rotary_kv and self.attention_backend != "triton"),
            "fused_decode_rotary_kv",
            "off unless attention_backend is 'triton' (it is part of the Triton decode kernel)",
            self.fused_decode_rotary_kv,
        )
        self._check_cuda_graphs()

    def _check_cuda_graphs(self) -> None:
        _require(
            self.cuda_graph_max_batch_size >= 1,
            "cuda_graph_max_batch_size",
            "at least 1",
            self.cuda_graph_max_batch_size,
        )
        _require(
            not (self.cuda_graphs and self.attention_backend != "triton"),
            "cuda_graphs",
            "off unless attention_backend is 'triton' (the torch backend's KV write reads a mask back to "
            "the host, which a CUDA graph cannot capture)",
            self.cuda_graphs,
        )
        _require(
            not (self.cuda_graphs and self.kv_cache == "none"),
            "cuda_graphs",
            "off when kv_cache is 'none' (without a cache no step is a one-token decode)",
            self.cuda_graphs,
        )
        _require(
            not (self.overlap_decode and not self.cuda_graphs),
            "overlap_decode",
            "off unless cuda_graphs is on (it overlaps graph replays)",
            self.overlap_decode,
        )

    @property
    def max_running(self) -> int:
        """Sequences in flight at once: one for sequential batching."""
        return 1 if self.batching == "sequential" else self.max_num_seqs

    def with_options(self, **options: Any) -> "EngineConfig":
        known = {f.name for f in fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return replace(self, **options)


def _require(ok: bool, name: str, requirement: str, value: object) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name} must be {requirement}, got {value!r}")
