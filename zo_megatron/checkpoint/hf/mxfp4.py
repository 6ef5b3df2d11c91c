"""MXFP4 weights (the OCP Microscaling format's FP4 E2M1 elements, one E8M0 scale per 32) -> real tensors.

OpenAI's GPT-OSS checkpoints store each MoE layer's expert weights this way (hf/gpt_oss.py): for a
projection `p`, `p_blocks` (uint8 [*rows, G, 16]: 16 bytes = 32 FP4 values, two per byte) and `p_scales`
(uint8 [*rows, G]: one exponent per block of 32, biased by 127). transformers dequantizes them when it
loads such a checkpoint without its Triton kernels (integrations/mxfp4.py, convert_moe_packed_tensors;
Mxfp4Config(dequantize=True)); this is the same arithmetic, written from the format:

    byte b of a block holds element 2b in its low nibble and element 2b + 1 in its high nibble;
    a nibble is E2M1: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa, no inf/NaN:
        0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6 and their negatives;
    value = element x 2^(scale - 127), computed in fp32 as torch.ldexp does (element x 2.0^e) and cast.

Every finite result is exact in bf16 (an element has two significant bits and bf16 has fp32's exponent
range): dequantizing to bf16 loses nothing, and to fp32 gives the same numbers. A scale of 255
(E8M0's NaN) gives inf x element as transformers' does (NaN for a zero element); no real checkpoint has one.

The rows are returned as stored, [*rows, G * 32]: for GPT-OSS's `gate_up_proj` that is [E, 2F, H], the
transpose of the [E, H, 2F] parameter transformers' model holds (which transposes after dequantizing).
"""
from __future__ import annotations

import torch

BLOCK = 32                          # elements per scale
BLOCK_BYTES = BLOCK // 2            # two FP4 elements per byte
SCALE_BIAS = 127

# the 16 FP4 E2M1 codes by their 4-bit value: positives 0-7, then the same with the sign bit set
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)

# rows dequantized at once: bounds the int64 index and fp32 temporaries (~ 32 x 12 bytes a row) to ~100 MB,
# whatever the tensor's size, beside the output itself
_ROWS_PER_CHUNK = 1 << 18


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> str | None:
    """Why a (blocks, scales) pair is not MXFP4 as GPT-OSS stores it (a phrase), None if it is."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return f"blocks and scales must be uint8 (got {blocks.dtype} and {scales.dtype})"
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES:
        return f"blocks must end in {BLOCK_BYTES} bytes a block (shape {tuple(blocks.shape)})"
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        return f"blocks {tuple(blocks.shape)} need scales {tuple(blocks.shape[:-1])} (got {tuple(scales.shape)})"
    return None


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [*rows, G, 16], scales uint8 [*rows, G] -> `dtype` [*rows, G * 32] (ValueError if the
    shapes or dtypes are not that)."""
    why = check_shapes(blocks, scales)
    if why is not None:
        raise ValueError(why)
    *rows, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, BLOCK_BYTES)            # one row per block of 32 elements
    flat_scales = scales.reshape(-1, 1)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    for start in range(0, flat_blocks.shape[0], _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, flat_blocks.shape[0])
        packed = flat_blocks[start:stop].long()
        # element 2b from the low nibble, 2b + 1 from the high one: [n, 16, 2] -> [n, 32]
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(stop - start, BLOCK)
        exponents = flat_scales[start:stop].to(torch.int32) - SCALE_BIAS
        out[start:stop] = torch.ldexp(table[codes], exponents).to(dtype)
    return out.reshape(*rows, groups * BLOCK)
