"""What cuBLASLt needs of the FP8 GEMMs' scales, which the CPU's emulation would not notice:
each found by a GPU run (bench/results/gpu_2026-11-26/) and checked here on the CPU."""

import pytest
import torch

import threefold.kernels.fp8 as fp8
import threefold.kernels.fp8_autograd as fp8_autograd
from threefold.kernels.fp8 import Fp8Linear, update_delayed_scales
from threefold.kernels.fp8_gemms import E4M3, _cublas_weight_scales, scaled_mm
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.kernels.reference import dequantize_blocks


@pytest.mark.parametrize("delayed", [True, False])
def test_the_gemms_scales_are_aligned_tensors_of_their_own(monkeypatch, delayed):
    """cuBLASLt reads a scale only from a 16-byte aligned address (CUBLAS_STATUS_NOT_SUPPORTED
    otherwise, as delayed scaling's step-2 GEMMs met on an H100 when the inverses were the
    elements of one (3,) buffer), and Inductor's scaled-GEMM lowering fails on a view: every
    scale the three GEMMs take, before and after the history, starts its own storage."""
    seen = []

    def checked(a, b, a_inverse, b_inverse, *args, **kwargs):
        seen.extend((a_inverse, b_inverse))
        return scaled_mm(a, b, a_inverse, b_inverse, *args, **kwargs)

    for module in (fp8, fp8_autograd):  # (the forward's and input gradient's; the weight's)
        monkeypatch.setattr(module, "scaled_mm", checked)
    layer = Fp8Linear(Fp8Recipe(fp8_format="hybrid", delayed=delayed))
    weight = torch.nn.Parameter(torch.randn(64, 32))
    for _ in range(2):  # delayed: current scaling, then the history's inverses
        layer.linear(torch.randn(16, 32, requires_grad=True), weight, None).sum().backward()
        if delayed:
            update_delayed_scales([layer], [])
    assert len(seen) == 12 and (layer.has_history or not delayed)
    for scale in seen:
        assert scale.storage_offset() == 0 and scale.data_ptr() % 16 == 0


def test_weight_block_scales_cublas_cannot_read_become_per_row_scales():
    """At k / 128 not a multiple of 4 a weight's 128 x 128 block scales go to the GEMM as the
    same scale for each row of a block (1 x 128): the weight it dequantizes to is the same
    bit for bit; at a multiple of 4 they go unchanged."""
    torch.manual_seed(0)
    for rows, cols in ((200, 384), (256, 320), (256, 512)):
        values = torch.randn(rows, cols).to(E4M3)
        inverses = torch.rand(-(-rows // 128), -(-cols // 128))
        got, block_rows = _cublas_weight_scales(inverses, 128, rows)
        assert (block_rows == 128) == (inverses.shape[1] % 4 == 0)
        assert (got is inverses) == (block_rows == 128)
        expected = dequantize_blocks(values, inverses, 128)
        assert torch.equal(dequantize_blocks(values, got, block_rows), expected)
