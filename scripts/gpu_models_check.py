"""Models on CUDA: own forward code vs transformers on the same device, in float32 and bfloat16.

Run on a GPU host (also runs on CPU, slowly). For every tiny random architecture: float32 logits and
48 greedy tokens must equal transformers'; bfloat16 is reported (token agreement, logit error), since
bf16 rounding legitimately flips near-ties. Real GGUF models found at the paths given are run the same
way, and a dummy 1B preset reports load time and peak memory. Prints one table; exits non-zero if a
float32 check fails.

    python scripts/gpu_models_check.py [--gguf PATH ...] [--device cuda]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import VOCAB, save_tiny_model, tiny_configs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tokenmill.benchmarks.load_memory import measure_load_memory  # noqa: E402
from tokenmill.reference import greedy_generate  # noqa: E402
from tokenmill.loading import load_model  # noqa: E402

NEW_TOKENS = 48
PROMPTS = ["The capital of France is", "def quicksort(arr):", "在一个美丽的早晨，", "Emoji test 🎉🚀 and more:"]


def hf_greedy(model: torch.nn.Module, prompt: list[int], device: str) -> tuple[torch.Tensor, list[int]]:
    """Greedy by full forward passes (the model's definition; HF's cached generate drifts for Gemma 3)."""
    sequence = list(prompt)
    first_logits = torch.empty(0)
    with torch.no_grad():
        for step in range(NEW_TOKENS):
            logits = model(torch.tensor([sequence], device=device)).logits[0, -1].float()
            first_logits = logits if step == 0 else first_logits
            sequence.append(int(logits.argmax()))
    return first_logits, sequence[len(prompt) :]


def compare(name: str, ours: torch.nn.Module, ref: torch.nn.Module, prompts: list[list[int]], device: str) -> dict:
    agree, total, worst = 0, 0, 0.0
    exact = True
    for prompt in prompts:
        ref_logits, ref_tokens = hf_greedy(ref, prompt, device)
        out = greedy_generate(ours, prompt, NEW_TOKENS)
        rel = float((out.prompt_logits - ref_logits).norm() / ref_logits.norm())
        worst = max(worst, rel)
        prefix = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref_tokens)) if a != b), NEW_TOKENS)
        agree += prefix
        total += NEW_TOKENS
        exact &= out.token_ids == ref_tokens
    return {"case": name, "tokens_agreeing_prefix": f"{agree}/{total}", "identical": exact, "logit_rel_err": worst}


def tiny_cases(device: str, dtype: torch.dtype) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (1, 9, 70)]
    for name in sorted(tiny_configs()):
        folder = Path(tempfile.mkdtemp())
        save_tiny_model(name, folder)
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        ours = load_model(folder, device=device, dtype=dtype).model
        rows.append(compare(f"tiny {name} {str(dtype)[6:]}", ours, ref, prompts, device))
        print(rows[-1], flush=True)
    return rows


def gguf_cases(path: Path, device: str, dtype: torch.dtype) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).to(device).eval()
    start = time.perf_counter()
    ours = load_model(path, device=device, dtype=dtype)
    row = compare(f"{path.name} {str(dtype)[6:]}", ours.model, ref, prompts, device)
    row["load_s"] = round(time.perf_counter() - start, 1)
    print(row, flush=True)
    return [row]


def engine_case(path: Path, device: str) -> dict:
    """The batched engine on the device: greedy outputs equal the single-sequence loop's."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path), device=device, dtype="bfloat16", max_model_len=512, num_kv_blocks=512)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    seconds = time.perf_counter() - start
    model = llm.engine.loaded.model
    same = [
        o.outputs[0].token_ids == greedy_generate(model, tokenizer.encode(p), 32).token_ids
        for o, p in zip(outputs, PROMPTS, strict=True)
    ]
    print(f"engine {path.name} bf16: {outputs[0].outputs[0].text!r}")
    row = {"case": f"engine {path.name} bf16 batch {len(PROMPTS)}", "identical": all(same), "seconds": seconds}
    print(row, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--dummy-preset", default="llama-3.2-1b")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {name}, torch {torch.__version__}")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += tiny_cases(args.device, dtype)
        for path in args.gguf:
            rows += gguf_cases(path, args.device, dtype)
    rows += [engine_case(path, args.device) for path in args.gguf]
    failed = [r["case"] for r in rows if "float32" in r["case"] and not r["identical"]]
    report = measure_load_memory(args.dummy_preset, args.device, "bfloat16", load_format="dummy")
    print(
        f"dummy {args.dummy_preset} bf16 on {args.device}: params {report.param_bytes / 2**30:.2f} GiB, "
        f"load peak {report.peak_bytes / 2**30:.2f} GiB ({report.peak_over_params:.2f}x), {report.seconds:.1f} s"
    )
    print("float32 failures:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
