"""Issue 18 on an H100/H200: decode steps of the engine with attention launched longest context first
(``seq_order``, the default) or in row order (``--row-order``), on a batch of uneven contexts. Dummy
``llama-3.1-8b`` (``--quantization`` / ``--kv-cache-dtype`` as given), ``--seqs`` sequences with prompts
of 300-1,500 random tokens; after their prefills, ``--steps`` decode steps timed on the host clock, then
the decode attention kernels of 10 steps under the torch profiler.

    PYTHONPATH=src python scripts/experiments/decode_order_engine.py [--row-order] [--quantization fp8]
"""

import argparse
import random
import statistics
import time

import torch

import tokenmill.kernels.attention.decode as decode
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row-order", action="store_true")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--seqs", type=int, default=178)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.row_order:
        decode.launch_waves = lambda num_programs, device: 1  # type: ignore[assignment]
    config = EngineConfig(model=args.model).with_options(
        load_format="dummy", dtype="bfloat16", device=args.device, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=2048, max_num_seqs=256,
    )  # fmt: skip
    engine = LLMEngine(config)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(args.seqs):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(300, 1500))]
        engine.add_request(str(i), prompt, params)

    def prefilling() -> bool:
        return any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running)

    while engine.num_waiting or prefilling():
        engine.step()
    for _ in range(5):
        engine.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    attention = [e.device_time for e in kernels if "_decode_kernel" in e.name]
    total = sum(e.device_time for e in kernels)
    label = "row order" if args.row_order else "seq_order"
    print(
        f"{label:9} {args.quantization}/{args.kv_cache_dtype} {args.seqs} seqs: step median "
        f"{statistics.median(times) * 1e3:.2f} ms (mean {statistics.mean(times) * 1e3:.2f}); "
        f"decode attention {statistics.mean(attention) if attention else 0:.1f} µs a call "
        f"over {len(attention)} calls, "
        f"{sum(attention) / 10 / 1e3:.2f} ms a step of {total / 10 / 1e3:.2f} ms kernel time",
        flush=True,
    )


if __name__ == "__main__":
    main()
