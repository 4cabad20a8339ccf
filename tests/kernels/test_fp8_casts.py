"""FP8 casts and their scales on the CPU: the scale arithmetic, saturation and rounding, why
rowwise and blockwise pieces need no amax collective, and every cast kernel bitwise the eager
reference (compiled; Triton on CUDA and in Triton's CPU interpreter)."""

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from threefold.kernels.fp8_gemms import E4M3, E5M2, quantize
from threefold.kernels.reference import rowwise_scale, scale_from_amax


def test_scale_maps_the_amax_onto_the_format_maximum_and_keeps_the_last_one_otherwise():
    previous = torch.tensor(3.0)
    assert scale_from_amax(torch.tensor(2.0), 448.0, 0, previous) == 224.0
    assert scale_from_amax(torch.tensor(2.0), 448.0, 2, previous) == 56.0  # 2^-margin
    for amax in (0.0, float("inf"), float("nan"), 1e-45):  # last: the scale would overflow
        assert scale_from_amax(torch.tensor(amax), 448.0, 0, previous) == 3.0


@pytest.mark.parametrize("dtype,maximum,mantissa_bits", [(E4M3, 448.0, 3), (E5M2, 57344.0, 2)])
def test_casts_saturate_and_round_to_the_nearest_fp8_value(dtype, maximum, mantissa_bits):
    values = torch.tensor([1e9, -1e9, maximum * 1.01])
    assert quantize(values, torch.tensor(1.0), dtype).float().tolist() == [
        maximum,
        -maximum,
        maximum,
    ]
    torch.manual_seed(0)
    x = torch.randn(10_000, dtype=torch.float64) * 3
    scale = maximum / x.abs().max().float()  # no value saturates, few are subnormal
    back = quantize(x, scale, dtype).double() / scale.double()
    normal = x.abs() * scale > torch.finfo(dtype).tiny
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= 2.0 ** -(mantissa_bits + 1)  # half a unit in the last place


def test_rowwise_scales_are_powers_of_two_per_row():
    amax = torch.tensor([[2.0], [3.0], [0.0], [float("inf")], [1e-45]])
    # 448 / 2 = 224 -> 128; 448 / 3 = 149.3 -> 128; nothing usable -> 1
    assert rowwise_scale(amax, 448.0, 0).flatten().tolist() == [128.0, 128.0, 1.0, 1.0, 1.0]
    assert rowwise_scale(amax[:2], 448.0, 1).flatten().tolist() == [64.0, 64.0]
    # 448 / amax just below 256, where log2 rounds up to 8: still 128, the amax maps below 448
    below = torch.nextafter(torch.tensor(1.75), torch.tensor(2.0))
    assert torch.log2(torch.div(448.0, below)) == 8.0
    assert rowwise_scale(below, 448.0, 0) == 128.0


def test_rowwise_pieces_scaled_by_their_own_amax_keep_the_rows_fp8_values():
    """Why rowwise scaling needs no amax reduction over the ranks holding pieces of a row (TP's
    features, CP's tokens): a piece's power-of-two scale is the row's times 2^k, k >= 0, so
    every value the whole row's cast represents as a normal E4M3 number comes out the same,
    and the values it flushes into subnormals come out at least as close. The control: exact
    (not power-of-two) scales, as tensorwise uses, move values everywhere."""
    torch.manual_seed(0)
    row = torch.randn(64, 256) * torch.logspace(-3, 3, 256)  # pieces of very different size

    def dequantized(t, scale):
        return quantize(t, scale, E4M3).double() / scale.double()

    def pow2(t):
        return rowwise_scale(t.abs().amax(1, keepdim=True), 448.0, 0)

    whole = dequantized(row, pow2(row))
    pieces = torch.cat([dequantized(p, pow2(p)) for p in row.chunk(4, dim=1)], dim=1)
    normal = row.abs() * pow2(row) >= torch.finfo(E4M3).tiny
    assert 0 < normal.float().mean() < 1
    assert torch.equal(pieces[normal], whole[normal])
    error = (whole - row.double()).abs(), (pieces - row.double()).abs()
    assert (error[1] <= error[0]).all() and (error[1] < error[0]).any()

    def exact(t):
        return 448.0 / t.abs().amax(1, keepdim=True)

    pieces = torch.cat([dequantized(p, exact(p)) for p in row.chunk(4, dim=1)], dim=1)
    moved = pieces[normal] != dequantized(row, exact(row))[normal]
    assert moved.float().mean() > 0.3


def test_blockwise_pieces_inside_one_devices_blocks_keep_its_fp8_values():
    """Why blockwise scaling matches one device in every layout that cuts its tensors at
    multiples of 128 or of a divisor of 128 (TP's features, CP's and SP's tokens, a sharded
    weight's rows): each piece of a block is scaled by a power of two at least the block's, so
    every value one device casts as a normal E4M3 number comes out the same (rowwise's
    argument, per block). The control: pieces cut at 96 straddle one device's blocks, take
    their scale from the larger one's amax, and flush the other one's small values into
    subnormals (a power-of-two scale moves no normal value: only those)."""
    from threefold.kernels import reference

    torch.manual_seed(0)
    # blocks of very different size: the first 128 features a million times smaller
    spread = torch.logspace(-1, 1, 512) * torch.where(torch.arange(512) < 128, 1e-4, 1e2)
    tensor = torch.randn(256, 512) * spread

    def dequantized(piece, block_rows):
        values, inverses = reference.fp8_cast_blocks(piece, E4M3, 448.0, 0, block_rows)
        return reference.dequantize_blocks(values, inverses, block_rows).double()

    def cut(columns, rows, block_rows):
        return torch.cat(
            [
                torch.cat([dequantized(piece, block_rows) for piece in band.split(columns, 1)], 1)
                for band in tensor.split(rows, 0)
            ]
        )

    for block_rows in (1, 128):
        whole = dequantized(tensor, block_rows)
        _, inverses = reference.fp8_cast_blocks(tensor, E4M3, 448.0, 0, block_rows)
        scales = reference.dequantize_blocks(torch.ones_like(tensor), inverses, block_rows)
        normal = tensor.abs() / scales >= torch.finfo(E4M3).tiny
        assert 0 < normal.float().mean() < 1
        for columns, rows in ((256, 128), (64, 256), (128, 32)):
            assert torch.equal(cut(columns, rows, block_rows)[normal], whole[normal])
        moved = cut(96, 256, block_rows)[normal] != whole[normal]
        assert moved.float().mean() > 0.02


def test_the_compiled_casts_are_the_eager_ones_bitwise():
    """What --fusion-impl compile (the default on CUDA without Triton) runs: one fused kernel
    per cast, and the scales with it."""
    from threefold.kernels import reference

    compiled = torch.compile(reference.fp8_cast_transpose)
    tensor = torch.randn(64, 48) * 30
    amax = tensor.abs().max()
    for dtype, limit in ((E4M3, 448.0), (E5M2, 57344.0)):
        scale = torch.tensor(448.0 / 120.0)
        for got, expected in zip(
            compiled(tensor, scale, dtype, limit),
            reference.fp8_cast_transpose(tensor, scale, dtype, limit),
        ):
            assert torch.equal(got.float(), expected.float())
        # delayed scaling's step amax: max-accumulated in place, in a view of the state
        step_amax = torch.tensor([0.0, 1e9, 0.0])
        compiled(tensor, scale, dtype, limit, step_amax[0])
        compiled(tensor, scale, dtype, limit, step_amax[1])
        assert step_amax.tolist() == [amax.item(), 1e9, 0.0]
    # current scaling's, the scale from the amax inside; rowwise's, a scale per row
    current = torch.compile(reference.fp8_cast_transpose_current)
    rows = torch.compile(reference.fp8_cast_rows)
    tensor[3] = 0.0
    for dtype, limit in ((E4M3, 448.0), (E5M2, 57344.0)):
        for margin in (0, 1):
            for amax_given in (amax, torch.tensor(0.0)):
                args = (tensor, amax_given, dtype, limit, margin)
                for got, expected in zip(
                    current(*args), reference.fp8_cast_transpose_current(*args)
                ):
                    assert torch.equal(got.float(), expected.float())
            for layout in (tensor, tensor.t()):
                args = (layout, dtype, limit, margin)
                for got, expected in zip(rows(*args), reference.fp8_cast_rows(*args)):
                    assert torch.equal(got.float(), expected.float())


def test_the_opaque_casts_are_one_operator_each_in_a_compiled_graph():
    """kernels/fp8_ops.py, what compiled layers cast with where the run's casts are Triton: in
    the graph each cast is one operator (none of the reference's ops for Inductor to fuse with
    a norm), and compiled it gives the eager cast's bytes and layouts (its fake version's
    strides are the real ones'), and max-accumulates delayed scaling's amax in place, into a
    view of the state. Each cast with an amax to record and without: torch 2.11, the GPUs',
    fails to trace an optional mutated argument given as None (tensorwise records none)."""
    from threefold.kernels import fp8_ops, reference

    graphs = []

    def inductor(graph, inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(graph)
        return compile_fx(graph, inputs)

    def casts(kernels, tensor, scale, step_amax):
        normed = tensor.relu() * 4  # a producer for Inductor to fuse into, exact
        return (
            *kernels.fp8_cast_transpose(normed, scale, E4M3, 448.0, step_amax[0]),
            *kernels.fp8_cast_transpose(normed, scale, E5M2, 57344.0),
            *kernels.fp8_cast_transpose_current(normed, kernels.amax(normed), E5M2, 57344.0, 1),
            *kernels.fp8_cast_transpose_current(
                normed, kernels.amax(normed), E4M3, 448.0, 0, step_amax[1]
            ),
            *kernels.fp8_cast_rows(normed.t(), E4M3, 448.0, 0),
            *kernels.fp8_cast_blocks(normed, E4M3, 448.0, 0, 1),
            *kernels.fp8_cast_blocks(normed, E4M3, 448.0, 0, 128),
        )

    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(casts, fp8_ops), backend=inductor, fullgraph=True)
    tensor, scale = torch.randn(200, 300) * 30, torch.tensor(448.0 / 120.0)
    step_amax, expected_amax = torch.tensor([0.0, 7.0]), torch.tensor([0.0, 7.0])
    got = compiled(tensor, scale, step_amax)
    expected = casts(reference, tensor, scale, expected_amax)
    for one, other in zip(got, expected, strict=True):
        assert one.dtype == other.dtype and one.stride() == other.stride()
        assert torch.equal(one.float(), other.float())
    assert torch.equal(step_amax, expected_amax) and step_amax[0] > 0
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    operators = [target for target in targets if target.startswith("threefold.")]
    assert sorted(operators) == sorted(
        f"threefold.{name}.default"
        for name in ("fp8_cast_transpose", "fp8_cast_transpose_recording")
        + ("fp8_cast_transpose_current", "fp8_cast_transpose_current_recording")
        + ("fp8_amax", "fp8_amax", "fp8_cast_rows", "fp8_cast_blocks", "fp8_cast_blocks")
    )
    casts_traced = [
        node
        for node in graph.graph.nodes
        if "float8" in str(node.args) and not str(node.target).startswith("threefold.")
    ]
    assert not casts_traced


def test_the_reference_casts_write_the_layouts_the_triton_kernels_allocate():
    """The opaque casts' fake versions run the reference (kernels/fp8_ops.py), so Inductor lays
    out the code around a cast by the reference's strides: they must be the Triton kernels'
    (`torch.empty` row-major FP8 values and transposes; `block_inverses`), for a row-major, a
    transposed and a column-major input, and in a dimension of one block (a GPU found both:
    the column-major cast and a single column of 1 x 128 blocks)."""
    from threefold.kernels import reference

    def row_major(rows, cols):
        return torch.empty(rows, cols).stride()

    for rows, cols in ((100, 70), (3, 200), (300, 129)):
        tensor = torch.randn(rows, cols)
        for layout in (tensor, tensor.t(), tensor.t().contiguous().t()):
            rows, cols = layout.shape
            amax = reference.amax(layout)
            for got in (
                reference.fp8_cast_transpose(layout, torch.tensor(2.0), E4M3, 448.0),
                reference.fp8_cast_transpose_current(layout, amax, E4M3, 448.0, 0)[:2],
            ):
                assert got[0].stride() == row_major(rows, cols)
                assert got[1].stride() == row_major(cols, rows)
            assert reference.fp8_cast_rows(layout, E4M3, 448.0, 0)[0].stride() == row_major(
                rows, cols
            )
            for block_rows in (1, 128):
                values, inverses = reference.fp8_cast_blocks(layout, E4M3, 448.0, 0, block_rows)
                blocks = (-(-rows // block_rows), -(-cols // 128))
                allocated = reference.block_inverses(*blocks, block_rows, layout.device)
                assert values.stride() == row_major(rows, cols)
                assert inverses.shape == allocated.shape == blocks
                assert inverses.stride() == allocated.stride()
                if block_rows == 1:  # outer-dimension-major, as cuBLASLt takes them
                    assert inverses.stride() == (1, blocks[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_the_triton_cast_transpose_and_amax_on_cuda_are_the_eager_ones_bitwise(source):
    """What an FP8 run on CUDA with Triton uses (kernels/triton_fp8.py): the same FP8 bytes in
    both layouts and the same amax, for tiles cut off at the edges, a transposed input, values
    on every side of the formats' ranges (saturated, rounded, subnormal) and a NaN's amax."""
    from threefold.kernels import reference, triton_fp8

    torch.manual_seed(0)
    for rows, cols in ((100, 70), (4096, 2048), (3, 200)):
        tensor = torch.randn(rows, cols, device="cuda") * torch.logspace(-6, 4, cols).cuda()
        tensor = tensor.to(source)
        for layout in (tensor, tensor.t().contiguous().t()):
            for dtype in (E4M3, E5M2):
                scale = torch.tensor(0.37, device="cuda")
                limit = float(torch.finfo(dtype).max)
                # a step's amax so far, below and above this tensor's, in a view of the state
                step_amax = torch.tensor([0.0, 1e9], device="cuda")
                got = triton_fp8.fp8_cast_transpose(layout, scale, dtype, limit, step_amax[0])
                triton_fp8.fp8_cast_transpose(layout, scale, dtype, limit, step_amax[1])
                expected = reference.fp8_cast_transpose(layout, scale, dtype, limit)
                for one, other in zip(got, expected):
                    assert one.shape == other.shape and torch.equal(one.float(), other.float())
                    assert one.stride() == other.stride()  # fp8_ops.py's fake versions'
                assert step_amax[0] == reference.amax(layout) and step_amax[1] == 1e9
            assert torch.equal(triton_fp8.amax(layout), reference.amax(layout))
    tensor[1, 1] = float("nan")  # non-finite either way: the previous scale is kept
    assert not torch.isfinite(triton_fp8.amax(tensor)) and not torch.isfinite(
        reference.amax(tensor)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_the_triton_current_rowwise_and_blockwise_casts_on_cuda_are_the_eager_ones_bitwise(source):
    """Current scaling's cast, its scale and inverse derived in the kernel from an amax, and
    rowwise and blockwise scaling's, each row's (1 x 128 or 128 x 128 block's) amax, power-of-two
    scale and inverse in one kernel: the same
    FP8 bytes and inverses as the eager reference, over twelve decades of values, edge tiles,
    a transposed view, a row of zeros, a margin, and an amax of nothing or not finite."""
    from threefold.kernels import reference, triton_fp8

    def same(kernel, *args):
        got, expected = getattr(triton_fp8, kernel)(*args), getattr(reference, kernel)(*args)
        for one, other in zip(got, expected, strict=True):
            assert one.shape == other.shape and torch.equal(one.float(), other.float()), kernel
            assert one.stride() == other.stride(), kernel  # fp8_ops.py's fake versions'

    torch.manual_seed(0)
    for rows, cols in ((100, 70), (4096, 2048), (3, 200), (33, 1000)):
        tensor = torch.randn(rows, cols, device="cuda") * torch.logspace(-6, 6, cols).cuda()
        tensor[1] = 0.0
        tensor = tensor.to(source)
        for layout in (tensor, tensor.t(), tensor.t().contiguous().t()):
            for dtype in (E4M3, E5M2):
                limit = float(torch.finfo(dtype).max)
                for margin in (0, 1):
                    for amax in (reference.amax(layout), torch.tensor(0.0, device="cuda")):
                        same("fp8_cast_transpose_current", layout, amax, dtype, limit, margin)
                    same("fp8_cast_rows", layout, dtype, limit, margin)
                    for block_rows in (1, 128):
                        same("fp8_cast_blocks", layout, dtype, limit, margin, block_rows)
    for amax in (3.0, 1e-45, float("inf"), float("nan")):
        args = (tensor[:2, :2], torch.tensor(amax, device="cuda"), E4M3, 448.0, 0)
        got = triton_fp8.fp8_cast_transpose_current(*args)[2]
        assert torch.equal(got, reference.fp8_cast_transpose_current(*args)[2])


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTERPRETED_CAST = """
import torch
from threefold.kernels import reference, triton_fp8
torch.manual_seed(0)
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for rows, cols in ((100, 70), (64, 128), (3, 200)):
        # FP8 values: the interpreter's casts round otherwise than a GPU's, exact values not
        tensor = (torch.randn(rows, cols) * 10).to(dtype).float()
        for layout in (tensor, tensor.t().contiguous().t(), tensor.bfloat16()):
            args = (layout, torch.tensor(1.0), dtype, float(torch.finfo(dtype).max))
            step_amax = torch.tensor([0.0, 1e9])
            got = triton_fp8.fp8_cast_transpose(*args, step_amax[0])
            triton_fp8.fp8_cast_transpose(*args, step_amax[1])
            expected = reference.fp8_cast_transpose(*args)
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, expected))
            assert step_amax[0] == reference.amax(layout) and step_amax[1] == 1e9
            assert torch.equal(triton_fp8.amax(layout), reference.amax(layout))
    # Current scaling (the scale from the amax in the kernel) and rowwise casts, at scales of
    # powers of two >= 1 (exact); the inverses at any amax (divided as PyTorch divides)
    limit = float(torch.finfo(dtype).max)
    tensor = (torch.randn(100, 300) * 10).to(dtype).float()
    tensor[3] = 0.0  # a row with no amax: scale 1
    for layout in (tensor, tensor.t(), tensor.t().contiguous().t(), tensor.bfloat16()):
        for amax, margin in ((limit / 4, 0), (limit / 2, 1), (0.0, 0)):
            args = (layout, torch.tensor(amax), dtype, limit, margin)
            step_amax = torch.tensor([0.0])
            got = triton_fp8.fp8_cast_transpose_current(*args, step_amax[0])
            expected = reference.fp8_cast_transpose_current(*args)
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, expected))
            assert step_amax[0] == reference.amax(layout)
        for margin in (0, 1):
            got = triton_fp8.fp8_cast_rows(layout, dtype, limit, margin)
            expected = reference.fp8_cast_rows(layout, dtype, limit, margin)
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, expected))
            for block_rows in (1, 128):  # blockwise: blocks cut short at the edges
                args = (layout, dtype, limit, margin, block_rows)
                got = triton_fp8.fp8_cast_blocks(*args)
                expected = reference.fp8_cast_blocks(*args)
                assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, expected))
    tensor[4, 2] = float("nan")  # that row's amax is not finite: scale 1
    assert torch.equal(
        triton_fp8.fp8_cast_rows(tensor, dtype, limit, 0)[1],
        reference.fp8_cast_rows(tensor, dtype, limit, 0)[1],
    )
    for amax in (3.0, 0.37, 1e-45, float("inf"), float("nan")):
        for margin in (0, 2):
            args = (tensor[:2, :2], torch.tensor(amax), dtype, limit, margin)
            got = triton_fp8.fp8_cast_transpose_current(*args)[2]
            assert torch.equal(got, reference.fp8_cast_transpose_current(*args)[2])
print("ok")
"""


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA machines)"
)
def test_the_triton_casts_write_every_layout_in_the_interpreter():
    """Where Triton is installed, its CPU interpreter runs the kernels' tiles, edge masks,
    transposed stores, scales from amaxes and rowwise loops on CPU tensors (the rounding is
    the GPU's to show: the `cuda` tests)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED_CAST], env=env, capture_output=True, text=True
    )
    if "only 0-dimensional arrays can be converted" in result.stderr:
        pytest.skip("this Triton's interpreter runs no loop of a runtime length under NumPy 2.4")
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
