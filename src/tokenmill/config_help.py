"""What each ``EngineConfig`` setting does, by its flat name: the help of its command-line flag.

Kept apart from ``config.py`` so the dataclasses stay short; ``config_flags`` adds the choices and the
default to each text. A setting without a line here is a test failure (tests/test_cli.py), so a new
toggle cannot ship with an empty ``--help``. ``CHOICES`` lists the accepted values of settings typed as
plain strings, so the parser refuses a bad one before anything heavy is imported.
"""

OPTION_HELP: dict[str, str] = {
    # the model
    "model": "model to load: an installed short name (smollm2, gemma3-270m), a Hugging Face folder, a "
    ".gguf file, a hub id, or with --load-format dummy a preset name (default: smollm2)",
    "tokenizer": "take the tokenizer (and chat template) from this model instead: a short name, folder, "
    ".gguf file or hub id; lets a dummy-weight model read and write text",
    "device": "cpu, cuda or cuda:N; auto picks cuda when it is available",
    "dtype": "weight and activation dtype; auto is bfloat16 on cuda, float32 on cpu",
    "load_format": "dummy: random weights of the named preset or config.json (real shapes, for benchmarks)",
    "quantization": "8-bit weights: int8 / fp8 quantize float weights per output channel as they load "
    "(weight-only PyTorch paths on cpu); none keeps them float; a pre-quantized checkpoint (fp8 128x128 "
    "blocks, compressed-tensors int8) loads as published; gguf keeps a .gguf file's 4- and 8-bit blocks "
    "packed (cpu only); auto: gguf for a .gguf file in float32 on the cpu, none otherwise",
    "seed": "seed of the dummy weights and of the engine's default sampling generator",
    "max_model_len": "longest sequence (prompt + output) in tokens; unset: the model's limit, at most 8192",
    "tensor_parallel_size": "split each layer over this many processes (one per GPU; gloo on cpu); rank 0 "
    "schedules, the others run the same forward pass on their shard",
    "custom_all_reduce": "under tensor parallelism on GPUs, all-reduces of up to 512 KiB (decode steps) "
    "through symmetric memory (one kernel reads every rank's buffer over NVLink) instead of NCCL; unset: "
    "on where it can be set up",
    "push_all_reduce": "with custom_all_reduce, all-reduces of up to 64 KiB (decode batches of a few rows) "
    "written into every rank's buffer with no barrier, each value announcing its own arrival; unset: on "
    "with custom_all_reduce",
    "debug_checks": "check the block allocator and the prefix tree after every step (slow)",
    "structured_output_backend": "grammar engine of structured outputs (JSON schema, regex, choice, "
    "grammar): llguidance, or xgrammar (pip install 'tokenmill[xgrammar]')",
    "structured_masks_ahead": "fill the next step's grammar masks in the background as soon as this "
    "step's tokens are read, instead of on the step's critical path",
    "warm_start": "run synthetic requests through every kernel at start-up, so none compiles inside a "
    "request; unset: on where Triton kernels compile (CUDA)",
    "host_threads": "torch's CPU threads in the engine's process; unset: 1 on a GPU unless OMP_NUM_THREADS "
    "is set (idle OpenMP threads spinning at their barriers slow the host's work, llguidance's masks "
    "among it), torch's default on cpu",
    "generation_config": "default sampling parameters (temperature, top_p, top_k, min_p, "
    "repetition_penalty, max_new_tokens as max_tokens) from a generation_config.json: auto reads the "
    "model folder's, vllm none (the built-in defaults), or a folder holding one; a request's own values win",
    "override_generation_config": "generation-config fields over the file's, a JSON object, e.g. "
    '\'{"temperature": 0.5, "max_new_tokens": 128}\' (null removes a default)',
    # the KV cache
    "kv_cache": "none recomputes everything every step; contiguous reserves max_model_len slots per "
    "sequence; paged takes blocks from a shared pool as sequences grow",
    "block_size": "tokens per KV block (paged)",
    "num_kv_blocks": "KV pool size in blocks; unset: sized from the GPU's free memory (cuda) or from "
    "--cpu-kv-cache-gib (cpu)",
    "gpu_memory_utilization": "share of the GPU's memory (of this process's share, under a per-process "
    "memory fraction) that weights, activations and the KV pool may take together",
    "cpu_kv_cache_gib": "KV pool size on cpu, in GiB; unset: room for max_num_seqs sequences of "
    "max_model_len tokens, at most 2 GiB",
    "prefix_caching": "reuse the KV blocks of prompt prefixes seen before (radix tree, LRU); paged only; "
    "unset: on with paged KV",
    "kv_cache_dtype": "what the KV pool stores: auto (the model's dtype) or fp8 (float8 e4m3, scale 1: half "
    "the bytes of 16-bit K/V; the triton and torch attention backends)",
    # the scheduler
    "batching": "sequential runs one request at a time; static admits a batch only when the last one has "
    "finished; continuous admits and retires requests at every step",
    "scheduling_policy": "fcfs serves in arrival order; priority serves the lowest request priority first "
    "and lets it preempt a worse running request",
    "max_num_seqs": "sequences running at once; unset: 256 on a GPU, 64 on cpu",
    "max_num_batched_tokens": "tokens one step may compute (prompt chunks and decodes together); unset: "
    "8192 on a GPU, 2048 on cpu (at least max_model_len without chunked prefill)",
    "chunked_prefill": "split long prompts across steps, sharing each step with running decodes; unset: "
    "on with a KV cache",
    "prefill_chunk_size": "most prompt tokens of one request per step; unset: the step budget",
    "admission": "paged KV: fit admits when the new tokens fit (growth may preempt); headroom keeps "
    "--admission-headroom of every running request's remaining output free; lookahead keeps what the "
    "busiest future step needs, so no request with a known max_tokens is preempted",
    "admission_headroom": "with --admission headroom: the share (0-1) of remaining output kept free",
    # the kernels
    "attention_backend": "torch: reference PyTorch attention (any device); triton: paged Triton kernels "
    "(a CUDA device, or TRITON_INTERPRET=1); cpu: the reference, but each decode step's attention (rotary, "
    "KV write, paged attention) in one C call a layer (float32 on cpu; needs a C compiler); auto: triton "
    "with CUDA + Triton, cpu on cpu where a C compiler is, else torch",
    "prepacked_cpu_linear": "float32 projections on cpu through oneDNN, each weight reordered once at "
    "start (a second copy of the weights in memory)",
    "gguf_activations": "quantization gguf: what each projection's inputs become before the products with "
    "the packed codes. float32: times the exact weights (matches transformers); int16 / int8 (AVX2 cpus): "
    "rounded per block of 32 and multiplied as integers, 1.2-1.5x faster decode. int16 keeps SmolLM2's "
    "greedy and top-1 tokens but moves logits by up to ~0.02; int8 is llama.cpp's rounding (top-1 agrees "
    "with float32 at 93 of 100 positions)",
    "gguf_decode_blocks": "quantization gguf: a decode step runs every plain Llama block in one C "
    "call over the same kernels (no Python between them); the same results bit for bit",
    "fused_rms_norm": "Triton RMSNorm with the residual add fused in; unset: on with CUDA + Triton",
    "fused_rotary": "Triton rotary embedding of q and k in place; unset: on with CUDA + Triton",
    "fused_activation": "Triton SwiGLU / GeGLU; unset: on with CUDA + Triton",
    "fused_gemv": "batch-1 projections as Triton GEMVs with the norm and activation fused into their "
    "loads; unset: on with CUDA + Triton",
    "fused_gemv_rows": "projections of 2-32 rows (small-batch decode, speculative verification) of weights "
    "under 2M elements through the Triton GEMV on the tensor cores instead of cuBLAS; unset: on with CUDA "
    "+ Triton",
    "fused_w8a8": "int8 / fp8 weights: projections of more than one row take 8-bit activations (per-token "
    "scales) on the 8-bit tensor cores; unset: on with CUDA + Triton",
    "fused_decode_rotary_kv": "Triton attention: decode steps rotate q and k and store the new K/V inside "
    "the decode kernel; unset: on with CUDA + Triton",
    "fused_prefill_rotary_kv": "Triton attention: prefill and verification steps rotate q and k and store "
    "the new K/V in one kernel; unset: on with CUDA + Triton",
    "split_prefill_attention": "Triton attention: prefill launches of at most 64 query tokens (speculative "
    "verification steps) split each query tile's keys over several programs; unset: on with CUDA + Triton",
    "fused_sampling": "temperature, top-k / min-p and the draw in one Triton pass; unset: on with CUDA + "
    "Triton",
    "programmatic_launch": "Hopper and later: launch the Triton kernels programmatically dependent (PDL); "
    "unset: on where supported",
    # CUDA graphs
    "cuda_graphs": "replay pure-decode steps from captured CUDA graphs (cuda + triton attention only); "
    "unset: on with triton attention on cuda",
    "cuda_graph_max_batch_size": "largest decode batch captured as a graph (at most max_num_seqs)",
    "cuda_graph_logits": "decode graphs of up to 16 rows also compute the logits and their argmax",
    "cuda_graph_prefill": "one sequence's prefill of up to 511 tokens replays a graph too (buckets of "
    "16..512 tokens), with --cuda-graphs",
    "overlap_decode": "queue the next decode step before this one's tokens are read back (needs "
    "--cuda-graphs); unset: on with CUDA graphs",
    # speculative decoding
    "speculative_method": "speculative decoding: ngram (prompt lookup: copy what followed the latest "
    "earlier occurrence of the output's last tokens) or draft_model (a smaller model with the same "
    "vocabulary); the model checks the guesses in one step, keeping its exact output distribution; "
    "unset: off",
    "num_speculative_tokens": "tokens guessed per step for each decoding sequence (k); unset: 24 for ngram "
    "on a GPU, 3 with packed GGUF weights on the CPU, else 4",
    "prompt_lookup_min": "ngram: the shortest suffix looked up in the prompt and output",
    "prompt_lookup_max": "ngram: the longest suffix looked up (the longest match wins)",
    "speculative_model": "draft_model: the draft model (short name, folder, .gguf file, or a preset with "
    "--speculative-load-format dummy)",
    "speculative_load_format": "draft_model: dummy for random weights of the named preset",
    "speculative_disable_by_batch_size": "no guesses in a step while this many sequences run (a large "
    "batch is compute-bound: verifying 1 + k tokens each costs more than it saves); unset: 8 on cpu, 32 "
    "on a GPU",
}

CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "load_format": ("auto", "dummy"),
}
