"""Programmatic dependent launch on a chain of GEMVs (CUDA host, Hopper or later).

Sixteen layers of llama-3.2-1b-shaped one-row projections (q/k/v with the residual add + RMSNorm fused in,
o_proj, gate/up with the norm, down with SwiGLU), random bf16 weights, captured in one CUDA graph and
replayed: with and without PDL, for the default tile choice and a few others. Prints the time per layer,
the share of the device copy bandwidth, and whether the PDL run's output equals the plain run's bit for
bit (``reports/gpu/pdl-gemv-chain-h200.log``).

    PYTHONPATH=src python scripts/gpu_pdl_chain.py
"""

import itertools
from collections.abc import Callable

import torch

from tokenmill.kernels._common import next_power_of_2
from tokenmill.kernels.gemv import GemvConfig, default_gemv_config, gated_gemv, gemv, rms_norm_gemv

HIDDEN, INTERMEDIATE, LAYERS, QKV = 2048, 8192, 16, 3072
ConfigChoice = Callable[[int, int], GemvConfig]


def make_layers(device: torch.device) -> list[dict[str, torch.Tensor]]:
    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * cols**-0.5

    def norm() -> torch.Tensor:
        return torch.rand(HIDDEN, device=device, dtype=torch.bfloat16) + 0.5

    return [
        {
            "qkv": weight(QKV, HIDDEN),
            "o": weight(HIDDEN, HIDDEN),
            "gate_up": weight(2 * INTERMEDIATE, HIDDEN),
            "down": weight(HIDDEN, INTERMEDIATE),
            "norm1": norm(),
            "norm2": norm(),
        }
        for _ in range(LAYERS)
    ]


def chain(
    layers: list[dict[str, torch.Tensor]], x: torch.Tensor, pdl: bool, choose: ConfigChoice
) -> torch.Tensor:
    hidden, residual = x, torch.zeros_like(x)
    for layer in layers:
        qkv, residual = rms_norm_gemv(
            hidden, layer["qkv"], layer["norm1"], 1e-5, residual, config=choose(QKV, HIDDEN), pdl=pdl
        )
        attended = gemv(qkv[:, :HIDDEN], layer["o"], config=choose(HIDDEN, HIDDEN), pdl=pdl)
        gate_up, residual = rms_norm_gemv(
            attended,
            layer["gate_up"],
            layer["norm2"],
            1e-5,
            residual,
            config=choose(2 * INTERMEDIATE, HIDDEN),
            pdl=pdl,
        )
        hidden = gated_gemv(gate_up, layer["down"], "silu", config=choose(HIDDEN, INTERMEDIATE), pdl=pdl)
    return hidden


def replay_us(run: Callable[[], torch.Tensor], reps: int = 300) -> tuple[float, torch.Tensor]:
    """Best of five timings of ``reps`` replays of ``run`` captured in a CUDA graph, and its output."""
    run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(20):
        graph.replay()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best, out.clone()


def copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (start.elapsed_time(end) * 1e-3)


def tile_choices() -> dict[str, ConfigChoice]:
    choices: dict[str, ConfigChoice] = {"default": default_gemv_config}
    for rows, warps in itertools.product((1, 2, 4), (4, 8)):
        choices[f"oneshot n{rows} w{warps}"] = lambda n, k, r=rows, w=warps: GemvConfig(
            r, next_power_of_2(k), w, 1
        )
    choices["k2048"] = lambda n, k: (
        GemvConfig(4, 2048, 8, 1) if k >= 8192 else GemvConfig(2 if n <= 2048 else 4, 2048, 4, 1)
    )
    return choices


def main() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    layers = make_layers(device)
    x = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    weight_bytes = sum(
        layer[name].numel() * 2 for layer in layers for name in ("qkv", "o", "gate_up", "down")
    )
    bandwidth = copy_bandwidth(device)
    print(
        f"device {torch.cuda.get_device_name()} copy {bandwidth / 1e12:.3f} TB/s; "
        f"weights {weight_bytes / 1e9:.3f} GB -> ideal {weight_bytes / bandwidth * 1e6:.1f} us",
        flush=True,
    )
    reference = chain(layers, x, False, default_gemv_config)
    for name, choose in tile_choices().items():
        plain = chain(layers, x, False, choose)
        for pdl in (False, True):
            us, out = replay_us(lambda p=pdl, c=choose: chain(layers, x, p, c))  # type: ignore[misc]
            error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            print(
                f"{name:20s} pdl={pdl!s:5}: {us:7.1f} us/16 layers ({us / LAYERS:5.2f} us/layer) = "
                f"{weight_bytes / (us * 1e-6) / bandwidth * 100:5.1f}% of copy bw; "
                f"eq no-pdl {torch.equal(out, plain)} rel err vs default {error:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
