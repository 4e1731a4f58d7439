"""Issue 18 on an H100/H200: decode attention's programs launched longest context first (the metadata's
``seq_order``) against row order, at a batch of sequences of uneven length (Nsight Compute on the float8
pool's kernel at 178 sequences of 300-1,500 keys: 2.7 waves of programs, SMs idle ~18% of the kernel).

bf16 and float8 pools; the sequences as drawn, and sorted longest / shortest first (where row order is
already one or the other); µs per launch under CUDA-graph replay, each output against float64 attention
over the pool's own values, and the ordered output against the unordered one (the same bits: each
program's work is the same, only its start differs).

    PYTHONPATH=src python scripts/experiments/decode_order_ab.py
"""

import functools
import pathlib
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fp8_kv_codes_ab import BOUND, HEAD_DIM, HEADS, pools, reference, workloads

from tokenmill.kernels.attention import paged_decode_attention


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for name in ("178 x 300-1500", "64 x 1024"):
        seq_lens = workloads()[name]
        key16, value16, tables = pools(seq_lens)
        query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        lengths = torch.tensor(seq_lens)
        rows = {
            "as drawn": torch.arange(len(seq_lens)),
            "longest first": torch.argsort(lengths, descending=True, stable=True),
            "shortest first": torch.argsort(lengths, stable=True),
        }
        for pool in ("bf16", "fp8"):
            dtype = torch.bfloat16 if pool == "bf16" else torch.float8_e4m3fn
            key, value = key16.to(dtype), value16.to(dtype)
            expected = reference(query, key, value, tables, seq_lens)
            for label, permutation in rows.items():
                index = permutation.cuda()
                q, t, lens = query[index], tables[index], lengths[permutation].int().cuda()
                order = torch.argsort(lens, descending=True, stable=True).int()
                outputs = {}
                for launch, seq_order in (("row order", None), ("seq_order", order)):
                    call = functools.partial(
                        paged_decode_attention, q, key, value, t, lens, BOUND, HEAD_DIM**-0.5, order=seq_order
                    )
                    outputs[launch] = call()
                    error = float(
                        (outputs[launch].double() - expected[index]).abs().max() / expected.abs().max()
                    )
                    us = triton.testing.do_bench_cudagraph(call, rep=200) * 1e3
                    print(
                        f"{name:16} {pool:5} rows {label:15} {launch:10} {us:8.1f} us  err {error:.1e}",
                        flush=True,
                    )
                same = torch.equal(outputs["row order"], outputs["seq_order"])
                print(f"{name:16} {pool:5} rows {label:15} ordered output equals the unordered one: {same}")
                assert same
        del key16, value16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
