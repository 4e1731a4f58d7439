"""Exploration for issue 18 on an H100/H200: batch-1 decode of dummy llama-3.1-8b (128-token prompt, 160
tokens, median of 3, each variant in a fresh process) with the 8-bit GEMV routing that
``gemv_occupancy_sweep.py`` suggests, against the defaults:

* ``tc4``: gate/up on the tensor-core GEMV with four pipeline stages instead of three (int8: gate/up and
  the LM head moved there from the CUDA cores);
* ``maxnreg128``: the CUDA-core GEMV of 8-bit weights compiled with at most 128 registers (from 9f2116b
  the default: ``no-maxnreg`` lifts it, ``maxnreg-skip-norm`` lifts it for the RMSNorm prologues only).

    PYTHONPATH=src python scripts/experiments/gemv_engine_ab.py [VARIANT ...]
"""

import sys

from decode_rate import run_variants

ENGINE = r"""
import sys, json
sys.path.insert(0, HERE)
from tokenmill.kernels import gemv
cfg = json.loads(sys.argv[1])
if cfg.get("tc_stages"):
    original_config = gemv.default_gemv_config
    def routed(out_features, in_features, weight_bytes=2, float8=False):
        if weight_bytes == 1 and out_features >= gemv.TENSOR_CORE_MIN_FEATURES:
            rows = 128 if out_features < 4 * gemv.TENSOR_CORE_MIN_FEATURES else 64
            return gemv.GemvConfig(rows, 256, 4, cfg["tc_stages"] if rows == 128 else 3, True)
        return original_config(out_features, in_features, weight_bytes, float8)
    gemv.default_gemv_config = routed
if cfg.get("maxnreg"):
    original_options = gemv.launch_options
    gemv.launch_options = lambda pdl: {**original_options(pdl), "maxnreg": cfg["maxnreg"]}
if cfg.get("no_maxnreg"):
    gemv.register_limit = lambda max_registers, on_cuda: {}
if cfg.get("maxnreg_skip_norm"):
    original_launch = gemv._launch
    def launch(x, weight, bias, prologue, in_features, config, *args, **kwargs):
        if config is None and prologue in (gemv.RMS_NORM, gemv.ADD_RMS_NORM) and weight.element_size() == 1:
            config = gemv.default_gemv_config(weight.shape[0], in_features, 1)._replace(max_registers=None)
        return original_launch(x, weight, bias, prologue, in_features, config, *args, **kwargs)
    gemv._launch = launch
from tokenmill import LLM
from decode_rate import decode_rate
llm = LLM(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", quantization=cfg["quantization"],
          max_model_len=512)
rate, rates = decode_rate(llm)
print("RESULT", sys.argv[1], f"{rate:.1f} tok/s", [round(r, 1) for r in rates], flush=True)
"""

VARIANTS = {
    "int8": {"quantization": "int8"},
    "int8-tc4": {"quantization": "int8", "tc_stages": 4},
    "int8-tc4-maxnreg128": {"quantization": "int8", "tc_stages": 4, "maxnreg": 128},
    "fp8": {"quantization": "fp8"},
    "fp8-tc4": {"quantization": "fp8", "tc_stages": 4},
    "int8-no-maxnreg": {"quantization": "int8", "no_maxnreg": True},
    "int8-maxnreg-skip-norm": {"quantization": "int8", "maxnreg_skip_norm": True},
    "fp8-no-maxnreg": {"quantization": "fp8", "no_maxnreg": True},
    "fp8-maxnreg-skip-norm": {"quantization": "fp8", "maxnreg_skip_norm": True},
}


def main(argv: list[str]) -> None:
    run_variants(ENGINE, VARIANTS, argv, ("RESULT",))


if __name__ == "__main__":
    main(sys.argv[1:])
