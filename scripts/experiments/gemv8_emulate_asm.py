"""CPU emulation of the packed PTX conversions in sweep.py (prmt default mode, f16x2 / bf16x2 arithmetic),
checked against torch for every 8-bit code in every lane. Checks the selectors and constants, not hardware."""
import numpy as np
import torch


def prmt(a, b, c):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (c >> (4 * i)) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out

def lanes(w, dt):
    return torch.tensor([w & 0xFFFF, w >> 16], dtype=torch.int32).to(torch.int16).view(dt) if False else \
        torch.tensor(np.array([w & 0xFFFF, w >> 16], dtype=np.uint16).view(np.int16)).view(dt)

def f16x2(w): return lanes(w, torch.float16)
def bf16x2(w): return lanes(w, torch.bfloat16)

def int8_to_f16(r):
    u = r ^ 0x80808080
    hi = 0x64646464
    k = f16x2(0x64806480)
    return torch.cat([f16x2(prmt(u, hi, 0x4140)) - k, f16x2(prmt(u, hi, 0x4342)) - k])

def e4m3_to_f16(r):  # cvt.rn.f16x2.e4m3x2: low byte -> low half (PTX); emulate with torch
    b = [(r >> (8 * i)) & 0xFF for i in range(4)]
    return torch.tensor(b, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)

def int8_to_f32_bits(r):
    u = r ^ 0x80808080
    m = 0x4B000000
    out = [prmt(u, m, 0x7540 + i) for i in range(4)]
    return torch.tensor(np.array(out, dtype=np.uint32).view(np.float32)) - 8388736.0

def int8_to_bf16(r):
    c = 0x43434343
    res = []
    for sel in (0x4140, 0x4342):
        a = prmt(r, c, sel)
        res.append(bf16x2(a & 0x437F437F) - bf16x2(a & 0x43804380))
    return torch.cat(res)

def e4m3_to_bf16(r):
    res = []
    for sel in (0x9180, 0xB3A2):
        a = ((prmt(r, 0, sel) << 4) & 0xFFFFFFFF) & 0x87F087F0
        res.append((bf16x2(a).float() * 2.0**120).to(torch.bfloat16))  # mul.rn.bf16x2 by 2^120: exact
    return torch.cat(res)

codes = np.arange(256)
bad = dict.fromkeys(("i8f16", "i8f32", "i8bf16", "e4f16", "e4bf16"), 0)
for lane in range(4):
    for c in codes:
        others = [(c * 7 + 13 * j) % 256 for j in range(4)]
        others[lane] = int(c)
        r = sum(b << (8 * j) for j, b in enumerate(others))
        want_i = torch.tensor(others, dtype=torch.uint8).view(torch.int8).float()
        f8 = torch.tensor(others, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        bad["i8f16"] += int((int8_to_f16(r).float() != want_i).sum())
        bad["i8f32"] += int((int8_to_f32_bits(r) != want_i).sum())
        bad["i8bf16"] += int((int8_to_bf16(r).float() != want_i).sum())
        nan = torch.isnan(f8)
        bad["e4f16"] += int(((e4m3_to_f16(r).float() != f8) & ~nan).sum())
        bad["e4bf16"] += int(((e4m3_to_bf16(r).float() != f8) & ~nan).sum())
print("mismatches over 4 lanes x 256 codes:", bad)
