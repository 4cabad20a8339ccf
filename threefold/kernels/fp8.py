"""FP8 linear layers: the scales, the three FP8 GEMMs, and each layer's scaling state.

A linear layer in FP8 computes, with one scale per tensor (s = FP8 max / amax / 2^margin),

    forward          y  = (q(x, sx) @ q(w, sw)^T) / (sx sw)            q: cast to E4M3, saturating
    input gradient   dx = (q(g, sg) @ q(w, sw)) / (sg sw)              g: E4M3, or E5M2 (hybrid)
    weight gradient  dw = (q(g, sg)^T @ q(x, sx)) / (sg sx)
                     (--no-fp8-wgrad: dw = g^T @ x in the run's precision, x kept unquantized)

through `torch._scaled_mm`: cuBLASLt's FP8 tensor-core GEMM on Hopper and later, and an exact
emulation on the CPU (products of FP8 values accumulated in fp32), so CI runs the very code a
GPU runs. Each operand is cast once, into both layouts the GEMMs take (a fused cast-transpose
when compiled); the transposed FP8 copies of x and w are all the layer keeps for backward (half
the bytes of bf16 ones). Biases, collectives and everything outside the GEMMs stay in the run's
dtype, except sequence parallelism's all-gather of a column-parallel layer's input, which
tensorwise and delayed scaling cast first and gather in FP8 (`Fp8Linear.gathers_in_fp8`).

Scales, as Transformer Engine's recipes (Megatron-LM's --fp8-recipe):

    tensorwise  each tensor's own amax, just before its cast (current scaling). Under tensor
                and context parallelism the amax is the maximum over the TP x CP group, so a
                sharded weight or activation is scaled as the whole tensor is on one device.
    delayed     the scale a step uses comes from the amax history of the steps before it; each
                step's amaxes (over its micro-batches) are reduced over TP x CP and DP once,
                at the step's end (`update_delayed_scales`), then pushed into the history. TE
                reduces and updates after every micro-batch's forward instead; once per step
                makes a data-parallel run scale exactly as one device does over the same batch.
    rowwise     (torchao's rowwise, not a Megatron-LM recipe) each GEMM operand scaled per row
                of the layout the GEMM reads, from that row's own amax, rounded down to a
                power of two: the forward's x and w per row of x and of w (over the input
                features), the input gradient's g per row and w per column (over the output
                features), the weight gradient's g and x per column (over the tokens). So
                x, w and g are each cast twice; one outlier costs its own row's precision
                only. A row split by TP (a row-parallel layer's input features, a column-
                parallel layer's output features) or by CP (the tokens) is scaled piece by
                piece, each by its own amax, with no collective: a piece's amax is at most
                the row's, so its power-of-two scale is the row's times 2^k, k >= 0, which
                moves no FP8 value off the row's grid (the FP8 formats are binary
                floating point); only values the whole row's cast would have flushed into
                E4M3's subnormals keep more bits. Every layout matches one device to the
                same tolerances as the other recipes.
    blockwise   (Megatron-LM's, Transformer Engine's Float8BlockScaling, DeepSeek-V3's) the
                same power-of-two scales per block instead of per row: 1 x 128 elements of
                each row of an activation or gradient in the layout its GEMM reads, and
                128 x 128 of a weight, whose transposed copy is the same bytes. The same
                argument holds per block wherever a rank's blocks lie inside one device's
                (the pieces a layout cuts are multiples of 128, or divide it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.kernels import fp8_ops, fp8_sequence_parallel, reference
from threefold.kernels.dispatch import KERNELS
from threefold.kernels.fp8_autograd import (
    GRAD,
    INPUT,
    WEIGHT,
    bias_grad,
    fine_grained_weight_grad,
    gather_fp8_rows,
    output_dtype,
    remember_layer,
    tensorwise_weight_grad,
)
from threefold.kernels.fp8_fsdp import Fp8GatheredWeight
from threefold.kernels.fp8_gemms import FP8_MAX, blockwise_mm, dequantization, rowwise_mm, scaled_mm
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.kernels.reference import scale_from_amax
from threefold.parallel.parallel_context import ONE_DEVICE, Group
from threefold.parallel.tensor_parallel.mappings import reduce_scatter_along_first_dim

# The buffers of `dequantization(scale_in_use)`, by INPUT, WEIGHT, GRAD (Fp8Linear).
INVERSES = ("input_inverse", "weight_inverse", "grad_inverse")


def held_for_step(tensor: torch.Tensor) -> bool:
    """A weight copy `Fp8Scaling.weights_cached` keeps for the step: every micro-batch saves
    that same copy for backward (activation offloading leaves it on the device)."""
    return getattr(tensor, "_held_for_step", False)


def _hold_for_step(*copies) -> None:
    for copy in copies:
        if isinstance(copy, tuple):
            _hold_for_step(*copy)
        elif isinstance(copy, torch.Tensor):
            copy._held_for_step = True


def _kernels():
    """Where the casts come from: the run's (`KERNELS`: one Triton kernel per cast on CUDA, a
    compiled one elsewhere); inside a compiled graph (a traced `Fp8Linear.linear`) the same as
    opaque operators where the run's are Triton (kernels/fp8_ops.py), else the reference,
    which the compiler fuses with the ops around it. The same bytes either way."""
    if not torch.compiler.is_compiling():
        return KERNELS
    return fp8_ops if KERNELS.opaque_fp8_casts else reference


class Fp8Linear(nn.Module):
    """The FP8 side of one linear layer: its recipe, the group its amaxes are reduced over,
    and, for delayed scaling, the scales in use, the amax history and this step's amaxes.

    Attached to a ColumnParallelLinear / RowParallelLinear as `.fp8` (threefold.model.fp8),
    whose forward then calls `linear` in place of `F.linear`. The buffers are not part of the
    module's state dict: checkpoints save them under layout-independent names (model/fp8.py)."""

    def __init__(
        self, recipe: Fp8Recipe, amax_group: Group = ONE_DEVICE, gradient_factor: float = 1.0
    ) -> None:
        """`gradient_factor`: how much larger this layout's gradients are than one device's
        (DP x CP: a rank divides the loss by its own micro-batch count and CP multiplies it).
        The amax history and scales are kept in one device's units, so they are the same in
        every layout and a checkpoint reshards into any other; the scale in use for
        gradients is divided by the factor, which for powers of two changes no FP8 value."""
        super().__init__()
        self.recipe, self.amax_group = recipe, amax_group
        self.register_buffer(
            "units", torch.tensor([1.0, 1.0, 1.0 / gradient_factor]), persistent=False
        )
        self.register_buffer("scale", torch.ones(3), persistent=False)
        self.register_buffer("scale_in_use", torch.ones(3), persistent=False)
        # `dequantization(scale_in_use)`, once per step rather than per cast (launches); a
        # 0-dim buffer per operand, not the elements of one (3,) buffer: cuBLASLt reads a
        # scale only from a 16-byte aligned address, which an element past the first is not
        # (CUBLAS_STATUS_NOT_SUPPORTED on an H100), and Inductor's scaled-GEMM lowering fails
        # on such a view.
        for name in INVERSES:
            self.register_buffer(name, torch.ones(()), persistent=False)
        self.register_buffer(
            "amax_history", torch.zeros(recipe.amax_history_len, 3), persistent=False
        )
        self.register_buffer("step_amax", torch.zeros(3), persistent=False)
        # Whether `amax_history` holds a step (a Python flag: no device sync per GEMM); set by
        # `push_amaxes`, and by `Fp8Scaling` after a checkpoint's state is loaded.
        self.has_history = False
        self.register_buffer(
            "fp8_max", torch.tensor([FP8_MAX[dtype] for dtype in recipe.dtypes]), persistent=False
        )
        # --fp8-param-gather: the weight reaches the GEMMs in FP8, cast once per step with
        # `gathered_scale` (threefold.model.fp8_params): under the distributed optimizer
        # `gathered`, (the weight, its FP8 copy) (a tuple: a parameter assigned to a module
        # attribute would become the module's); under FSDP2 the weight itself is FP8.
        self.param_gather = False
        self.gathered: tuple[nn.Parameter, torch.Tensor] | None = None
        self.register_buffer("gathered_scale", torch.ones(()), persistent=False)
        # Blockwise: the inverses of that copy's scales, one per 128 x 128 block (set by
        # threefold.model.fp8_params, which knows the weight's shape).
        self.register_buffer("gathered_inverses", None, persistent=False)
        # One training step's FP8 weight: (the weight, its transposed FP8 copy, its
        # `dequantization`, its row-major FP8 copy), cast by the first micro-batch and read by
        # the others (`Fp8Scaling.weights_cached`); rowwise and blockwise: (the weight,
        # `fine_grained_weight`'s copies it keeps).
        self.cache_weight = False
        self.weight_cache: tuple | None = None
        # Whether a sequence-parallel input is all-gathered in FP8: cast on each rank with the
        # scale of the whole gathered tensor (tensorwise: the amax reduced over TP x CP, as the
        # gathered tensor's is; delayed: the history's, the same on every rank), so the
        # gathered bytes are exactly the cast of the gathered input, 1 byte an element on the
        # wire instead of bf16's 2. Not rowwise or blockwise: the transposed copy needs scales
        # per feature over the sequence (or its blocks), which no rank has before the gather.
        # Nor with --no-fp8-wgrad, whose weight gradient takes the gathered input unquantized.
        self.gathers_in_fp8 = recipe.gathers_in_fp8
        # Whether `linear` may be traced into a compiled layer's graph (--compile-layers
        # without pipeline parallelism: threefold.model.fp8.convert_to_fp8); see `linear`.
        self.traced = False

    def cast(
        self, index: int, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input, weight or gradient (INPUT, WEIGHT, GRAD; 2-D) in FP8, row-major and
        transposed, and the `dequantization` of the scale it was cast with. Delayed scaling
        from its history takes one launch: the scale and its inverse are the step's, and the
        cast max-accumulates the amax into `step_amax` itself."""
        return self.cast_part(index, tensor, self.current_amax(tensor))

    def current_amax(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The amax a cast of `tensor` derives its scale from (current scaling: tensorwise,
        and delayed scaling's first step, which has no history yet), reduced over
        `amax_group`: where `tensor` is this rank's slice of a sequence-parallel tensor, the
        whole gathered tensor's. None where delayed scaling scales from its history.

        (TE starts delayed scaling from scale 1, which flushes most gradients to zero, and
        would do so differently in every layout: a rank's gradients are DP x CP times one
        device's, which a scale from the tensor's own amax cancels.)"""
        if self.recipe.delayed and self.has_history:
            return None
        return self.amax_group.all_reduce(_kernels().amax(tensor), op=dist.ReduceOp.MAX)

    def cast_part(
        self, index: int, tensor: torch.Tensor, current: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`cast` of `tensor`, or of a part of the tensor whose `current_amax` is `current`,
        with that whole tensor's scale: the slices of a sequence gathered in the run's dtype
        (--tp-comm-overlap with --no-fp8-wgrad) are cast as they arrive into the bytes of
        the gathered tensor's cast. Delayed scaling records each part's amax into
        `step_amax` (max-accumulated, so the parts record the whole's)."""
        dtype, kernels = self.recipe.dtypes[index], _kernels()
        # evaluation leaves the state as it was; tensorwise records nothing
        record = self.step_amax[index] if self.recipe.delayed and self.training else None
        if current is None:
            scale, inverse = self.scale_in_use[index], getattr(self, INVERSES[index])
            quantized, transposed = kernels.fp8_cast_transpose(
                tensor, scale, dtype, FP8_MAX[dtype], record
            )
            return quantized, transposed, inverse
        # (the cast derives the scale and its inverse from the amax itself)
        return kernels.fp8_cast_transpose_current(
            tensor, current, dtype, FP8_MAX[dtype], self.recipe.margin, record
        )

    def cast_fine(self, index: int, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rowwise or blockwise scaling: an input or gradient (2-D, or a transposed view: its
        copy comes out row-major) cast with a power-of-two scale per row, or per 1 x 128 block
        of a row, from this rank's piece of it (module doc: no reduction over the ranks
        holding the rest), and the scales' inverses, which the GEMM takes ([rows, 1]; [rows,
        cols / 128]): one launch with Triton."""
        dtype, kernels = self.recipe.dtypes[index], _kernels()
        limit, margin = FP8_MAX[dtype], self.recipe.margin
        if self.recipe.blockwise:
            return kernels.fp8_cast_blocks(tensor, dtype, limit, margin, 1)
        return kernels.fp8_cast_rows(tensor, dtype, limit, margin)

    def fine_grained_mm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        a_inverses: torch.Tensor,
        b_inverses: torch.Tensor,
        out_dtype: torch.dtype,
        weight: bool = False,
        fast_accum: bool = False,
    ) -> torch.Tensor:
        """`rowwise_mm` or `blockwise_mm` of operands `cast_fine` (or `fine_grained_weight`,
        for `b` with `weight`) cast. Blockwise GEMMs accumulate in full (cuBLASLt's take no
        fast accumulation)."""
        if self.recipe.blockwise:
            block_rows = reference.FP8_BLOCK if weight else 1
            return blockwise_mm(a, b, a_inverses, b_inverses, out_dtype, block_rows)
        return rowwise_mm(a, b, a_inverses, b_inverses, out_dtype, fast_accum)

    def fine_grained_weight(self, weight: torch.Tensor, cached: bool = True) -> tuple[tuple, tuple]:
        """Rowwise or blockwise scaling: the weight [out, in] in FP8 for the forward and
        transposed for the input gradient, each with its scales' inverses. Rowwise: cast per
        row and per column (per input feature), the transposed cast kept for the step like
        `weight_in_fp8`'s copy (the one backward saves) and the forward's, which nothing saves,
        cast per call (keeping it too would hold another byte per weight through the step for
        one cast per micro-batch). Blockwise: one cast per 128 x 128 block, whose transpose
        is the transposed copy (the same blocks), both kept. `cached=False`: cast now, whatever
        the step keeps (a traced `linear`)."""
        cache = self._step_copies(weight, cached)
        if cache is not None:
            kept = cache[1]
        else:
            kept = self._cast_weight_fine(weight)
            if cached and self.cache_weight:
                self.weight_cache = (weight, kept)
                _hold_for_step(kept)
        if self.recipe.blockwise:
            return kept
        return self.cast_fine(WEIGHT, weight), kept

    def _cast_weight_fine(self, weight: torch.Tensor):
        """What `fine_grained_weight` keeps: rowwise the transposed cast; blockwise both
        layouts, from the gathered copy with --fp8-param-gather (its transpose, once a step)."""
        if not self.recipe.blockwise:
            return self.cast_fine(WEIGHT, weight.t())
        weight8, inverses = self.gathered_fp8(weight), self.gathered_inverses
        if weight8 is None:
            dtype = self.recipe.dtypes[WEIGHT]
            weight8, inverses = _kernels().fp8_cast_blocks(
                weight, dtype, FP8_MAX[dtype], self.recipe.margin, reference.FP8_BLOCK
            )
        return (weight8, inverses), (weight8.t().contiguous(), inverses.t().contiguous())

    def weight_in_fp8(
        self, weight: torch.Tensor, cached: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weight in FP8, row-major and transposed, and the inverse of its scale
        (`dequantization`): the gathered copy with --fp8-param-gather, else cast now. Inside
        `Fp8Scaling.weights_cached` the first micro-batch's copies and inverse are kept and
        serve every later micro-batch, which saves that same transposed copy for backward.
        Both layouts are kept (the gathered copy as the row-major one): transposing the kept
        one back per micro-batch, to save that byte per weight, took 15 ms of GPU time per
        step of the 1B bench on an H100 (1-byte elements transpose slowly). `cached=False`: cast
        now, whatever the step keeps (a traced `linear`: module doc)."""
        cache = self._step_copies(weight, cached)
        if cache is not None:
            _, transposed, inverse, weight8 = cache
            return weight8, transposed, inverse
        weight8 = self.gathered_fp8(weight)
        if weight8 is not None:
            result = weight8, weight8.t().contiguous(), dequantization(self.gathered_scale)
        else:
            result = self.cast(WEIGHT, weight)
        if cached and self.cache_weight:
            self.weight_cache = (weight, result[1], result[2], result[0])
            _hold_for_step(*result)
        return result

    def _step_copies(self, weight: torch.Tensor, cached: bool) -> tuple | None:
        """The step's kept copies of `weight` (`weight_cache`), if any. An eager call finds them
        by the weight's identity. A traced one (`cached=False`) takes them as they are: cast
        before the step's first forward (`cast_step_weight`), they are inputs of the graph,
        which reads them for every micro-batch instead of casting the weight again (an
        identity test would be a guard on the parameter)."""
        cache = self.weight_cache
        if not self.cache_weight or cache is None or (cached and cache[0] is not weight):
            return None
        return cache

    def cast_step_weight(self, weight: torch.Tensor) -> None:
        """Casts `weight` for the step now, eager, into `weight_cache` (under
        `Fp8Scaling.weights_cached`): a traced `linear` cannot keep what it casts."""
        with torch.no_grad():
            if self.recipe.fine_grained:
                self.fine_grained_weight(weight)
            else:
                self.weight_in_fp8(weight)

    def gathered_fp8(self, weight: torch.Tensor) -> torch.Tensor | None:
        """--fp8-param-gather's FP8 copy of `weight` (FSDP2's gathered weight itself, or the
        distributed optimizer's copy of it), cast with `gathered_scale` (blockwise:
        `gathered_inverses`); None without the flag."""
        if isinstance(weight, Fp8GatheredWeight):
            return weight.fp8
        if self.gathered is not None and self.gathered[0] is weight:
            return self.gathered[1]
        return None

    def use_history(self) -> None:
        """Scale from the history from now on (after a checkpoint's state is loaded; at a
        step's end `push_amaxes` does this for every layer at once)."""
        self.scale_in_use.copy_(self.scale * self.units)
        _set_inverses([self], self.scale_in_use.unsqueeze(0))
        self.has_history = True

    def inverses(self) -> list[torch.Tensor]:
        """The buffers of `dequantization(scale_in_use)`: INPUT's, WEIGHT's, GRAD's."""
        return [getattr(self, name) for name in INVERSES]

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        accumulate_in_main_grad: bool = False,
        sequence_parallel: Group | None = None,
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` with FP8 GEMMs. `accumulate_in_main_grad`: the weight
        gradient is added to `weight.main_grad` in fp32 (--gradient-accumulation-fusion), as
        it always is for a weight stored in FP8 (--fp8-param-gather), which could not hold a
        gradient of its own. `sequence_parallel` (where `gathers_in_fp8`): `x` is this rank's
        slice of the sequence, all-gathered over that TP group in FP8.

        Inside a layer compiled whole (--compile-layers), a `traced` layer's call is part of
        the layer's graph unless it communicates (`_traceable`): its casts fuse with the ops
        around them (a norm's output is written in FP8 as it is computed) and the step makes
        no Python call per GEMM; on an H100 the 1B model's FP8 step was bound by those. The
        weight's copies are cast before the step (`cast_step_weight`) and read by the graph
        (outside a training step, as in evaluation, the graph casts them itself), and the
        gradient buffer's `grad_added_to_main_grad` is set here, not by the backward (a
        compiled backward cannot set an attribute): exact while every
        backward follows its own forward, so not under pipeline parallelism, whose 1F1B runs
        the next forward first (and whose backward would find the FP8 state and main_grad,
        saved by the forward, changed in place). Everywhere else the call runs eager."""
        accumulate = accumulate_in_main_grad or weight.dtype in FP8_MAX
        if not (self.traced and self._traceable(sequence_parallel)):
            return self._eager(x, weight, bias, accumulate, sequence_parallel)
        if accumulate and weight.requires_grad and torch.is_grad_enabled():
            weight.grad_added_to_main_grad = True
            weight.main_grad_is_zero = False  # (a compiled backward adds: `_weight_grad`)
        return self._function(x, weight, bias, accumulate, sequence_parallel, traced=True)

    def all_gather_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tp: Group,
        accumulate_in_main_grad: bool = False,
    ) -> torch.Tensor:
        """`linear` of `x`, this rank's slice of the sequence, all-gathered over `tp` in ring
        steps beside the slices' GEMMs (--tp-comm-overlap: kernels/fp8_sequence_parallel.py)."""
        return fp8_sequence_parallel.fp8_all_gather_linear(
            self, x, weight, bias, tp, accumulate_in_main_grad
        )

    def linear_reduce_scatter(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        tp: Group,
        accumulate_in_main_grad: bool = False,
        overlap: bool = True,
    ) -> torch.Tensor:
        """A row-parallel `linear` (no bias) reduce-scattered over the sequence: in ring steps
        with `overlap`, else the plain collectives with the gradient gathered in FP8
        (kernels/fp8_sequence_parallel.py)."""
        return fp8_sequence_parallel.fp8_linear_reduce_scatter(
            self, x, weight, tp, accumulate_in_main_grad, overlap
        )

    def _traceable(self, sequence_parallel: Group | None) -> bool:
        """Whether this call runs no collective: no FP8 gather of a sequence-parallel input,
        and no amax reduced over ranks (rowwise and blockwise scaling reduce none, delayed
        scaling none once it has a history). Traced into a graph, the gloo/NCCL calls would
        hang."""
        if sequence_parallel is not None:
            return False
        recipe = self.recipe
        return (
            recipe.fine_grained
            or self.amax_group.size == 1
            or (recipe.delayed and self.has_history)
        )

    @torch.compiler.disable
    def _eager(self, x, weight, bias, accumulate: bool, sequence_parallel: Group | None):
        return self._function(x, weight, bias, accumulate, sequence_parallel, traced=False)

    def _function(self, x, weight, bias, accumulate: bool, sequence_parallel, traced: bool):
        if self.recipe.fine_grained:
            return _Fp8FineGrainedLinearFunction.apply(x, weight, bias, self, accumulate, traced)
        arguments = (x, weight, bias, self, accumulate, traced, sequence_parallel)
        return _Fp8LinearFunction.apply(*arguments)

    def extra_repr(self) -> str:
        return self.recipe.describe()


class _Fp8LinearFunction(torch.autograd.Function):
    """The three GEMMs of an FP8 linear layer. Each operand is cast once, in both layouts:
    the forward uses x8 and w8 (w8^T is column-major as it is), backward the transposes
    x8^T, w8^T (saved instead of x8, w8: the same bytes) and g8, g8^T (--no-fp8-wgrad: x
    itself is saved, and g8^T unused, for the weight gradient's GEMM). With `tp` (sequence
    parallelism) x is this rank's slice of the sequence: cast, all-gathered over `tp` as FP8
    bytes and transposed after the gather; the input gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear, accumulate: bool, traced: bool, tp=None):
        inputs = x.reshape(-1, x.shape[-1])
        x8, x8_t, input_inverse = fp8.cast(INPUT, inputs)
        shape = x.shape  # of the input the GEMMs take: the whole sequence under `tp`
        if tp is not None:
            x8 = gather_fp8_rows(x8, tp)
            x8_t = x8.t().contiguous()
            shape = (tp.size * x.shape[0], *x.shape[1:])
        w8, w8_t, weight_inverse = fp8.weight_in_fp8(weight, cached=not traced)
        out_dtype = output_dtype(x)
        output = scaled_mm(x8, w8.t(), input_inverse, weight_inverse, out_dtype, fast_accum=True)
        if bias is not None:
            output = output + bias.to(out_dtype)
        kept = (x8_t, input_inverse) if fp8.recipe.fp8_wgrad else (inputs, None)
        ctx.save_for_backward(*kept, w8_t, weight_inverse)
        remember_layer(ctx, x, weight, bias, fp8, accumulate, traced)
        ctx.tp, ctx.input_shape = tp, shape
        return output.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_kept, input_inverse, w8_t, weight_inverse = ctx.saved_tensors
        fp8 = ctx.fp8
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        g8, g8_t, grad_inverse = fp8.cast(GRAD, grads)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8, w8_t.t(), grad_inverse, weight_inverse, ctx.dtype)
            grad_x = grad_x.view(ctx.input_shape)
            if ctx.tp is not None:
                grad_x = reduce_scatter_along_first_dim(grad_x, ctx.tp)
        grad_weight = tensorwise_weight_grad(ctx, grads, x_kept, input_inverse, g8_t, grad_inverse)
        return grad_x, grad_weight, bias_grad(ctx, grads), None, None, None, None


class _Fp8FineGrainedLinearFunction(torch.autograd.Function):
    """The three GEMMs of an FP8 linear layer under rowwise or blockwise scaling. Each operand
    is cast in the layout its GEMM reads and scaled per row (or 1 x 128 block of a row) of it:
    x and w for the forward; g with w^T for the input gradient; g^T and x^T for the weight
    gradient (a blockwise weight per 128 x 128 block, w^T the same blocks). Saved for
    backward: x^T and w^T, each with its scales' inverses (--no-fp8-wgrad: x itself, not
    cast for the weight gradient, nor is g^T)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear, accumulate: bool, traced: bool):
        inputs = x.reshape(-1, x.shape[-1])
        x8, x_inverses = fp8.cast_fine(INPUT, inputs)
        kept = fp8.cast_fine(INPUT, inputs.t()) if fp8.recipe.fp8_wgrad else (inputs, None)
        (w8, w_inverses), (w8_t, w_t_inverses) = fp8.fine_grained_weight(weight, not traced)
        out_dtype = output_dtype(x)
        output = fp8.fine_grained_mm(
            x8, w8.t(), x_inverses, w_inverses, out_dtype, weight=True, fast_accum=True
        )
        if bias is not None:
            output = output + bias.to(output.dtype)
        ctx.save_for_backward(*kept, w8_t, w_t_inverses)
        remember_layer(ctx, x, weight, bias, fp8, accumulate, traced)
        return output.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_kept, x_t_inverses, w8_t, w_t_inverses = ctx.saved_tensors
        fp8 = ctx.fp8
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            g8, g_inverses = fp8.cast_fine(GRAD, grads)
            grad_x = fp8.fine_grained_mm(
                g8, w8_t.t(), g_inverses, w_t_inverses, ctx.dtype, weight=True
            )
            grad_x = grad_x.view(ctx.input_shape)
        grad_weight = fine_grained_weight_grad(ctx, grads, x_kept, x_t_inverses)
        return grad_x, grad_weight, bias_grad(ctx, grads), None, None, None


def update_delayed_scales(states: list[Fp8Linear], groups: list[Group]) -> None:
    """At a step's end: every layer's step amaxes reduced (max) over `groups` (TP x CP, then
    DP: all the ranks of a pipeline stage) in one message each, then pushed into the
    histories (`push_amaxes`)."""
    if not states:
        return
    step_amax = torch.stack([state.step_amax for state in states])
    for group in groups:
        group.all_reduce(step_amax, op=dist.ReduceOp.MAX)
    push_amaxes(states, step_amax)


def _set_inverses(states: list[Fp8Linear], in_use: torch.Tensor) -> None:
    """Each layer's inverse buffers (`Fp8Linear.inverses`) from its row of `in_use`, the
    scales in use ([layers, 3]), in one multi-tensor copy."""
    inverses = [inverse for state in states for inverse in state.inverses()]
    torch._foreach_copy_(inverses, list(dequantization(in_use).reshape(-1).unbind(0)))


def push_amaxes(states: list[Fp8Linear], step_amax: torch.Tensor) -> None:
    """Delayed scaling at a step's end, for the layers of `states` (of one recipe) at once: the
    step's reduced amaxes ([layers, 3]) enter the histories (newest first), the next step's
    scales and their inverses follow, and the step amaxes start again from 0 (a weight gathered
    in FP8 keeps its own: it is recorded when the weight is cast, not per forward). Stacked, and
    written back by one multi-tensor copy per buffer: a few dozen launches per step however
    many layers, where each layer's update took some twenty (a step's launches bound the 1B
    model's FP8 step on an H100)."""
    recipe, fp8_max = states[0].recipe, states[0].fp8_max
    units = torch.stack([state.units for state in states])
    history = torch.roll(torch.stack([state.amax_history for state in states]), 1, dims=1)
    history[:, 0] = step_amax * units
    chosen = history[:, 0] if recipe.amax_compute_algo == "most_recent" else history.amax(1)
    previous = torch.stack([state.scale for state in states])
    scale = scale_from_amax(chosen, fp8_max, recipe.margin, previous)
    in_use = scale * units
    for field, value in (("amax_history", history), ("scale", scale), ("scale_in_use", in_use)):
        torch._foreach_copy_([getattr(state, field) for state in states], list(value.unbind(0)))
    _set_inverses(states, in_use)
    cleared = [state.step_amax for state in states if not state.param_gather] + [
        state.step_amax[index] for state in states if state.param_gather for index in (INPUT, GRAD)
    ]
    torch._foreach_zero_(cleared)
    for state in states:
        state.has_history = True
