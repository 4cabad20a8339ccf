"""The FP8 formats and GEMMs: `torch._scaled_mm` with one scale per tensor, per row or per
block of each operand (cuBLASLt's FP8 tensor cores on Hopper and later; on the CPU an exact
emulation: products of FP8 values summed in fp32, so CI runs the arithmetic a GPU runs). Each
GEMM takes the inverses of the scales its operands were cast with (kernels/fp8.py casts them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.kernels import reference
from threefold.kernels.dispatch import KERNELS

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}  # 448, 57344


def fp8_dtypes(fp8_format: str) -> tuple[torch.dtype, torch.dtype]:
    """(activations and weights, gradients): Megatron-LM's --fp8-format."""
    return (E4M3, E5M2) if fp8_format == "hybrid" else (E4M3, E4M3)


def quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor x scale in FP8, saturating at the format's max."""
    return reference.fp8_cast(tensor, scale, dtype, FP8_MAX[dtype])


# cuBLASLt's FP8 GEMMs take only an inner dimension that is a multiple of 16 (`_scaled_mm`
# refuses others). An expert's weight-gradient GEMM sums over that expert's tokens, any number
# of them, so its operands are padded with zeros, which add nothing to any sum (Megatron-LM
# pads the routing instead, --moe-router-padding-for-fp8).
INNER_MULTIPLE = 16


def pad_inner(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 `a` [m, k] row-major and `b` [k, n] column-major with k padded by zeros to a
    multiple of `INNER_MULTIPLE`, in the same layouts; unchanged where it is one. Padded as
    bytes: byte 0 is +0 in both FP8 formats, and a byte pad runs on every device."""
    missing = -a.shape[1] % INNER_MULTIPLE
    if not missing:
        return a, b

    def padded(rows: torch.Tensor) -> torch.Tensor:  # [r, k] row-major -> [r, k + missing]
        return F.pad(rows.contiguous().view(torch.uint8), (0, missing)).view(rows.dtype)

    return padded(a), padded(b.t()).t()


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, **arguments) -> torch.Tensor:
    """`torch._scaled_mm`; on the CPU, run eagerly, with oneDNN off. With oneDNN on (the
    default) a 512 x 256 x 512 FP8 GEMM took 5.1 s on a 2-core Xeon with AMX-BF16/INT8; off,
    ATen's emulation (the operands in fp32, one fp32 GEMM, bitwise) 11 ms. (A compiled graph
    cannot hold the switch: it calls the operator as the flag stands when the graph runs.)"""
    if a.device.type != "cpu" or torch.compiler.is_compiling() or not torch.backends.mkldnn.enabled:
        return torch._scaled_mm(a, b, **arguments)
    torch.backends.mkldnn.enabled = False
    try:
        return torch._scaled_mm(a, b, **arguments)
    finally:
        torch.backends.mkldnn.enabled = True


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inverse: torch.Tensor,
    b_inverse: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(a x a_inverse) @ (b x b_inverse) for FP8 `a` [m, k], row-major, and `b` [k, n],
    column-major, as cuBLASLt takes them (the cast-transposes produce both layouts); the
    inverses are of the scales the operands were cast with (`dequantization`), each computed
    once per cast rather than once per GEMM: on a GPU an FP8 step is bound by its launches.

    `fast_accum`: Hopper's FP8 tensor cores accumulate in fewer bits than fp32; without it
    cuBLASLt moves the partial sums into fp32 registers every few steps of k (TE's "split
    accumulator"), which costs time. As Transformer Engine and torchao, the forward GEMM
    accumulates fast and the two gradient GEMMs, whose sums are longer and noisier, do not.
    (The CPU's emulation sums in fp32 either way.) `out`: written there (row-major [m, n], of
    `out_dtype`)."""
    a, b = pad_inner(a, b)
    scales = dict(scale_a=a_inverse, scale_b=b_inverse, use_fast_accum=fast_accum)
    if out is not None:
        return _scaled_mm(a, b, **scales, out_dtype=out_dtype, out=out)
    return _scaled_mm(a, b, **scales, out_dtype=out_dtype)


# A weight gradient as one operator of a compiled graph, which calls it with main_grad and the
# gradient buffer's flag themselves: a graph cannot branch on a flag that changes between its
# runs (a step's first micro-batch writes, the others add), so the operator decides as it runs.
@torch.library.custom_op("threefold::fp8_weight_grad_into", mutates_args=("main_grad", "zeroed"))
def weight_grad_into(
    main_grad: torch.Tensor,
    zeroed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_inverse: torch.Tensor,
    b_inverse: torch.Tensor,
) -> None:
    """`scaled_mm(a, b, ...)` into `main_grad`: written there by the GEMM while `zeroed` (a
    CPU tensor) says main_grad still holds the step's zeros, which saves an add reading and
    writing main_grad (the flag then cleared); else computed in fp32 and added."""
    if bool(zeroed) and main_grad.is_contiguous():
        scaled_mm(a, b, a_inverse, b_inverse, main_grad.dtype, out=main_grad)
        zeroed.fill_(False)
    else:
        main_grad.add_(scaled_mm(a, b, a_inverse, b_inverse, torch.float32))


@weight_grad_into.register_fake
def _(main_grad, zeroed, a, b, a_inverse, b_inverse) -> None:
    return None


def unquantized_mm(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """a @ b of operands in the run's precision (--no-fp8-wgrad's weight gradient), in
    `out_dtype`: bf16 operands into fp32 through mm's out_dtype on CUDA (fp32 sums, never
    rounded to bf16, as Transformer Engine's weight-gradient GEMM adds into main_grad);
    elsewhere, which has no such kernel, from fp32 copies: the same exact products. Under
    autocast (fp32 parameters) `b` may be fp32 beside a bf16 `a`: it is rounded to bf16, as
    autocast's linear would have."""
    b = b.to(a.dtype)
    if a.dtype == out_dtype:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype, out=out)
    result = torch.mm(a.to(out_dtype), b.to(out_dtype))
    return result if out is None else out.copy_(result)


def dequantization(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale: what a GEMM multiplies an operand cast with `scale` by. A new tensor, so it
    can be saved for backward as it is (a delayed scale is updated in place at the step's
    end)."""
    return scale.reciprocal()


def rowwise_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inverses: torch.Tensor,
    b_inverses: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """`scaled_mm` with a scale per row of `a` and per column of `b`, given by their inverses
    as `Fp8Linear.cast_fine` returns them: [m, 1], and [n, 1] per row of the transposed copy
    `b` is a view of."""
    a, b = pad_inner(a, b)
    scales = dict(scale_a=a_inverses, scale_b=b_inverses.view(1, -1), use_fast_accum=fast_accum)
    # Compiled, a refusal would come from inside the graph, where it cannot be caught: on
    # CUDA the graph asks for bf16 from the start.
    compiled_on_gpu = torch.compiler.is_compiling() and a.device.type == "cuda"
    if out_dtype == torch.float32 and KERNELS.fp8_rowwise_fp32_output and not compiled_on_gpu:
        try:
            return _scaled_mm(a, b, **scales, out_dtype=out_dtype)
        except RuntimeError:  # an argument check, before any kernel ran: bf16 from now on
            KERNELS.fp8_rowwise_fp32_output = False
    out = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
    return _scaled_mm(a, b, **scales, out_dtype=out).to(out_dtype)


def _cublas_weight_scales(
    inverses: torch.Tensor, block_rows: int, rows: int
) -> tuple[torch.Tensor, int]:
    """A weight's 128 x 128 block inverses ([rows / 128, k / 128]) as cuBLASLt computes them
    right: unchanged where k / 128 is a multiple of 4; otherwise the same inverse for each
    row of a block ([rows, k / 128], then a 1 x 128 x 1 x 128 GEMM, exact all the same). On
    an H100 with torch 2.11, 128 x 128 scales at k / 128 = 3 gave garbage: cuBLASLt reads
    their rows at a 16-byte stride, and `_scaled_mm` accepts them only unpadded."""
    if block_rows > 1 and inverses.shape[1] % 4:
        return inverses.repeat_interleave(block_rows, 0)[:rows], 1
    return inverses, block_rows


def blockwise_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inverses: torch.Tensor,
    b_inverses: torch.Tensor,
    out_dtype: torch.dtype,
    b_block_rows: int,
) -> torch.Tensor:
    """`scaled_mm` with a scale per block: `a` [m, k] row-major, its inverses per 1 x 128
    block ([m, k / 128]); `b` [k, n] column-major, a view of its transposed copy [n, k], whose
    inverses are per block of that copy (`b_block_rows` 1: [n, k / 128]; 128, a weight's:
    [n / 128, k / 128]). On CUDA cuBLASLt's blockwise GEMM (Hopper; CUDA 12.9 or later): bf16
    output only, no fast accumulation, the 1 x 128 scales outer-dimension-major (as the casts
    write them: the copies below are then views). Elsewhere an emulation: the operands
    dequantized exactly (powers of two) and multiplied in fp32. Both take the weight's scales
    as `_cublas_weight_scales` gives them, so the CPU's tests cover that too."""
    b_inverses, b_block_rows = _cublas_weight_scales(b_inverses, b_block_rows, b.shape[1])
    if a.device.type == "cuda":
        a, b = pad_inner(a, b)  # within the last 128-block of k: the same inverses
        scale_a = a_inverses.t().contiguous().t()
        scale_b = b_inverses.t() if b_block_rows > 1 else b_inverses.t().contiguous()
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    a32 = reference.dequantize_blocks(a, a_inverses, 1)
    b32 = reference.dequantize_blocks(b.t(), b_inverses, b_block_rows)
    return (a32 @ b32.t()).to(out_dtype)
