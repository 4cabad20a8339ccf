"""The kernels a run uses, chosen once at start-up (`configure`) and logged in one line.

Model code calls `KERNELS.rms_norm(...)`, `KERNELS.attention(...)`, ... and never asks which
implementation answers. Until `configure` runs (tests, tools, conversion) every entry is the
eager reference of `threefold.kernels.reference`.

Order of preference, each optional: Transformer Engine (core attention) > apex (norms) >
PyTorch-native fast paths: SDPA restricted to the best backend that runs the model's shapes,
torch.compile'd norms / SwiGLU / GELU / RoPE / cross-entropy chunks (Triton on GPU, C++ on
CPU), the chunked cross-entropy, and PyTorch's fused AdamW (`threefold.training.optimizer`).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from threefold.config import ModelConfig
from threefold.config.errors import ConfigError
from threefold.config.fp8 import Fp8Config
from threefold.config.kernels import KernelConfig
from threefold.kernels import reference
from threefold.kernels.cross_entropy import (
    fused_vocab_parallel_cross_entropy,
    softmax_gradient,
    sum_of_exponentials,
)
from threefold.kernels.determinism import deterministic_environment, use_deterministic_algorithms
from threefold.kernels.external import ApexNorms, TEAttention, try_import
from threefold.kernels.fp8_shapes import check_fp8_shapes
from threefold.parallel.context_parallel.block_attention import block_kernel
from threefold.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

# Megatron's --attention-backend names onto SDPA's backends.
_SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "fused": SDPBackend.CUDNN_ATTENTION,
    "unfused": SDPBackend.MATH,
    "local": SDPBackend.MATH,
}
# What `auto` tries on CUDA. Of those that run the model's shapes, MATH aside, the fastest at
# the model's sequence and micro-batch is used (timed at start-up); without a sequence, the
# first in this order.
_CUDA_PREFERENCE = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)

# SDPA backends whose backward is deterministic under torch.use_deterministic_algorithms.
_DETERMINISTIC = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@dataclass(frozen=True)
class AttentionShape:
    heads: int  # query heads per tensor-parallel rank
    groups: int  # key/value heads per tensor-parallel rank
    head_dim: int
    dropout: float
    # The model's sequence and micro-batch (0: unknown): `auto` on CUDA times the backends
    # that run at this shape and keeps the fastest.
    sequence: int = 0
    batch: int = 1


class Kernels:
    """The implementations in use. Attributes are plain callables with the signatures of the
    functions in `threefold.kernels.reference` (and `cross_entropy(logits, target, vocab, tp)`)."""

    def __init__(self) -> None:
        self.use_reference()

    def use_reference(self) -> None:
        self.layer_norm = reference.layer_norm
        self.rms_norm = reference.rms_norm
        self.swiglu = reference.swiglu
        self.swiglu_stacked = reference.swiglu_stacked
        self.gelu = reference.gelu
        self.squared_relu = reference.squared_relu  # eager; --compile-layers fuses it
        self.rotary = reference.rotary
        self.rotary_interleaved = reference.rotary_interleaved
        self.split_rotary = reference.split_rotary
        self.attention = reference.attention
        self.cross_entropy = vocab_parallel_cross_entropy
        self.amax = reference.amax
        self.fp8_cast_transpose = reference.fp8_cast_transpose
        self.fp8_cast_transpose_current = reference.fp8_cast_transpose_current
        self.fp8_cast_rows = reference.fp8_cast_rows
        self.fp8_cast_blocks = reference.fp8_cast_blocks
        # Inside compiled layers: the casts as opaque operators (kernels/fp8_ops.py), which
        # run the ones above, rather than the reference for Inductor to fuse.
        self.opaque_fp8_casts = False
        # Whether a rowwise-scaled torch._scaled_mm writes fp32 (the CPU's does; cuBLASLt's
        # rowwise kernels have written bf16 only): turned off by kernels/fp8.py's first try.
        self.fp8_rowwise_fp32_output = True
        self.description = "reference (eager PyTorch)"
        self.gradient_accumulation_fusion = False


KERNELS = Kernels()


def _sdpa_with(backend: SDPBackend, expand_groups: bool):
    """Core attention restricted to one SDPA backend. Masked calls (packed fine-tuning) are
    left to SDPA's own choice: the flash kernels take no arbitrary masks."""

    def attention(query, key, value, attention_mask, dropout):
        if attention_mask is not None:
            return reference.attention(query, key, value, attention_mask, dropout)
        if expand_groups and key.shape[2] != query.shape[2]:
            repeat = query.shape[2] // key.shape[2]
            key, value = (t.repeat_interleave(repeat, dim=2) for t in (key, value))
        with sdpa_kernel([backend]):
            return reference.attention(query, key, value, None, dropout)

    return attention


def _inputs(
    shape: AttentionShape, sequence: int, batch: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    query = torch.randn(
        sequence, batch, shape.heads, shape.head_dim, device=device, dtype=dtype, requires_grad=True
    )
    key, value = (
        torch.randn(
            sequence,
            batch,
            shape.groups,
            shape.head_dim,
            device=device,
            dtype=dtype,
            requires_grad=True,
        )
        for _ in range(2)
    )
    return query, key, value


def _runs(
    backend: SDPBackend,
    shape: AttentionShape,
    device: torch.device,
    dtype: torch.dtype,
    expand_groups: bool,
) -> bool:
    """Whether `backend` runs forward and backward for the model's attention shapes."""
    try:
        with warnings.catch_warnings():  # SDPA explains each refusal in a warning
            warnings.simplefilter("ignore")
            _sdpa_with(backend, expand_groups)(
                *_inputs(shape, 16, 2, device, dtype), None, shape.dropout
            ).sum().backward()
    except RuntimeError:  # "No available kernel" and its relatives
        return False
    return True


def _milliseconds(
    attention, shape: AttentionShape, device: torch.device, dtype: torch.dtype
) -> float:
    """Forward and backward time of one layer's core attention at the model's shape (the
    median of 5 timed runs after 2 warm-ups), agreed over ranks (their maximum) so that every
    rank picks the same backend."""
    import torch.distributed as dist

    query, key, value = _inputs(shape, shape.sequence, shape.batch, device, dtype)
    grad = torch.randn(
        shape.sequence, shape.batch, shape.heads * shape.head_dim, device=device, dtype=dtype
    )
    times = []
    for _ in range(7):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        attention(query, key, value, None, shape.dropout).backward(grad)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor(sorted(times[2:])[2], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


# A backend later in the preference order must beat the earlier choice by this much: two
# backends a few percent apart would otherwise swap between restarts on timing noise, and a
# resumed run would then not repeat the interrupted one bitwise.
_SPEED_MARGIN = 0.9
# Every backend is timed this many times, in turn, and keeps its best: on a freshly started
# H100 the first process timed cuDNN's attention at 4.85 ms where the later ones timed 2.16,
# so it ran FlashAttention (3.89 ms) and its 8b-8l step took 9% longer
# (bench/results/gpu_mfu_fp8_2026-11-26/). A backend slow only while it warms up is timed
# again after the others.
_TIMING_ROUNDS = 3


def _fastest(
    candidates: list[tuple[object, str]],
    shape: AttentionShape,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[object, str]:
    """The fastest of the backends that run (FlashAttention-2 is not always first: on Hopper
    cuDNN's fused attention can be faster), with every timing in the log line: each one's
    best of `_TIMING_ROUNDS` timings taken in turn. The earliest in preference order wins
    unless another is at least 10% faster."""
    if len(candidates) == 1 or shape.sequence <= 0:
        return candidates[0]
    best = [float("inf")] * len(candidates)
    for _ in range(_TIMING_ROUNDS):
        for index, (kernel, _) in enumerate(candidates):
            best[index] = min(best[index], _milliseconds(kernel, shape, device, dtype))
    timed = [(ms, kernel, label) for ms, (kernel, label) in zip(best, candidates)]
    chosen = timed[0]
    for entry in timed[1:]:
        if entry[0] < _SPEED_MARGIN * chosen[0]:
            chosen = entry
    report = ", ".join(
        f"{label.removeprefix('SDPA ')} {ms:.2f} ms"
        for ms, _, label in sorted(timed, key=lambda entry: entry[0])
    )
    _, kernel, label = chosen
    return kernel, (
        f"{label}, the fastest forward+backward at sequence {shape.sequence} "
        f"x micro-batch {shape.batch} (by 10% to pass an earlier choice): {report}"
    )


def _choose_attention(
    config: KernelConfig, te, shape: AttentionShape, device: torch.device, dtype: torch.dtype
) -> tuple[object, str]:
    backend = config.attention_backend
    if te is not None and backend in ("auto", "flash", "fused"):
        if backend != "auto":  # TE picks among its backends from these variables
            os.environ["NVTE_FLASH_ATTN"] = "1" if backend == "flash" else "0"
            os.environ["NVTE_FUSED_ATTN"] = "1" if backend == "fused" else "0"
        return TEAttention(te), f"Transformer Engine DotProductAttention ({backend})"
    if backend == "auto" and not _on_gpu(device):
        return reference.attention, "SDPA (PyTorch's choice on CPU)"
    wanted = _CUDA_PREFERENCE if backend == "auto" else (_SDPA_BACKENDS[backend],)
    if config.deterministic_mode and _on_gpu(device):
        # FlashAttention's and cuDNN's backward add into dQ with atomics (kernels/determinism.py)
        if backend in ("flash", "fused"):
            raise ConfigError(
                f"--attention-backend {backend} with --deterministic-mode: its backward is not "
                "deterministic in SDPA; use auto (memory-efficient attention) or unfused"
            )
        wanted = tuple(b for b in wanted if b in _DETERMINISTIC)
    runnable = []
    for candidate in wanted:
        for expand in (False, True):  # some backends lack grouped-query support: expand K/V
            if _runs(candidate, shape, device, dtype, expand):
                label = f"SDPA {candidate.name}" + (" (K/V expanded per head)" if expand else "")
                runnable.append((_sdpa_with(candidate, expand), label))
                break
    # MATH materializes the s x s scores: only a last resort, never timed against the others.
    fused = [entry for entry in runnable if "MATH" not in entry[1]]
    if fused:
        return _fastest(fused, shape, device, dtype)
    if runnable:
        return runnable[0]
    raise ConfigError(
        f"--attention-backend {backend}: SDPA cannot run head size "
        f"{shape.head_dim}, attention dropout {shape.dropout}, "
        f"{str(dtype).removeprefix('torch.')} on {device.type} with it; "
        "choose another backend"
    )


def _compiled(function, backend: str = "inductor"):
    # dynamic=None: static shapes first, a dynamic kernel if the shapes change (evaluation).
    return torch.compile(function, backend=backend)


def _require_cpu_compiler(flag: str) -> None:
    """On the CPU, inductor writes compiled graphs as C++: without a compiler the first step
    would fail deep inside torch.compile, after the model and data are built."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as error:  # noqa: BLE001 - InvalidCxxCompiler and its causes alike
        raise ConfigError(
            f"{flag} on the CPU needs a C++ compiler for torch.compile "
            f"({str(error).splitlines()[0]}); install g++ or set CXX, or use "
            "--fusion-impl eager without --compile-layers"
        ) from error


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


# The FP8 layers' kernels: the amax, and the casts of each recipe (kernels/reference.py).
_FP8_CASTS = (
    "amax",
    "fp8_cast_transpose",
    "fp8_cast_transpose_current",
    "fp8_cast_rows",
    "fp8_cast_blocks",
)


def _check_cpu_rowwise_gemm() -> None:
    """The CPU's torch._scaled_mm takes a scale per row from torch 2.13 on; before, only one
    per tensor (an internal assert deep in the first step)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError as error:
        raise ConfigError(
            f"--fp8-recipe rowwise: this torch ({torch.__version__}) cannot run FP8 GEMMs with "
            "a scale per row on the CPU (torch 2.13 can); use tensorwise, delayed or "
            "blockwise here, or a GPU"
        ) from error


def _fp8_gemms(device: torch.device, recipe: str, fp8_format: str) -> str:
    """Whether torch._scaled_mm runs on this device (cuBLASLt's FP8 GEMMs need compute
    capability 8.9: Ada, Hopper and later; its block-scaled ones Hopper and CUDA 12.9); the
    log entry."""
    blockwise = recipe == "blockwise"
    if not _on_gpu(device):
        if blockwise:
            return "emulated block by block (CPU: the blocks dequantized exactly, an fp32 GEMM)"
        if recipe == "rowwise":
            _check_cpu_rowwise_gemm()
        return "torch._scaled_mm (CPU: exact emulation, fp32 accumulation)"
    one = torch.ones((), device=device)
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except RuntimeError as error:
        raise ConfigError(
            f"--fp8-format: this GPU cannot run FP8 GEMMs ({str(error).splitlines()[0]}); "
            "FP8 needs compute capability 8.9 or later (Ada, Hopper); drop --fp8-format"
        ) from error
    if not blockwise:
        return "torch._scaled_mm (cuBLASLt FP8 tensor cores)"
    from threefold.kernels.fp8_gemms import blockwise_mm, fp8_dtypes  # (it imports this module)

    x = torch.ones(128, 256, device=device)
    rows, square = torch.ones(128, 2, device=device), torch.ones(1, 2, device=device)
    forward, backward = fp8_dtypes(fp8_format)
    try:  # x or g by the weight (forward, input gradient), g^T by x (weight gradient)
        for dtype in {forward, backward}:
            a, b = x.to(dtype), x.to(forward).t()
            blockwise_mm(a, b, rows, square, torch.bfloat16, 128)
            blockwise_mm(a, b, rows, rows, torch.bfloat16, 1)
    except RuntimeError as error:
        raise ConfigError(
            f"--fp8-recipe blockwise: this GPU or torch cannot run block-scaled FP8 GEMMs "
            f"({str(error).splitlines()[0]}); they need Hopper and CUDA 12.9 or later; use "
            "tensorwise or delayed"
        ) from error
    return "torch._scaled_mm (cuBLASLt FP8 tensor cores, 1 x 128 and 128 x 128 block scales)"


def _gradient_accumulation_fusion(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the weight-gradient GEMM can add into an fp32 gradient buffer here: same-dtype
    addmm_ always; a bf16/fp16 GEMM into fp32 needs addmm's out_dtype (CUDA, torch >= 2.8)."""
    if dtype == torch.float32:
        return True
    a = torch.ones(16, 16, device=device, dtype=dtype)
    out = torch.ones(16, 16, device=device)
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((out == 17).all())


def configure(
    config: KernelConfig,
    device: torch.device,
    dtype: torch.dtype,
    normalization: str,
    attention: AttentionShape,
    fp8: Fp8Config | None = None,
    pipeline_parallel_size: int = 1,
) -> str:
    """Select every kernel for this run; returns the start-up log line. `fp8` (enabled): the
    linear layers' GEMMs run in FP8 (--fp8-format, --fp8-recipe). `pipeline_parallel_size`:
    whether the weight gradients of compiled layers can go into the gradient buffer."""
    in_fp8 = fp8 is not None and fp8.enabled
    KERNELS.use_reference()
    cuda = _on_gpu(device)
    compile_fusions = config.fusion_impl == "compile" or (config.fusion_impl == "auto" and cuda)
    backend = config.compile_backend
    fuse = functools.partial(_compiled, backend=backend) if compile_fusions else lambda f: f
    how = "torch.compile" if compile_fusions else "eager"

    te = None
    if config.transformer_impl != "local":
        te = try_import("transformer_engine.pytorch") if cuda else None
        if te is None and config.transformer_impl == "transformer_engine":
            raise ConfigError(
                "--transformer-impl transformer_engine: Transformer Engine "
                + ("does not import" if cuda else "needs CUDA GPUs")
                + "; install it on a GPU machine or pass --transformer-impl local"
            )
    impl = "transformer_engine" if te is not None else "local"
    if backend != "inductor" and not (compile_fusions or config.compile_layers):
        raise ConfigError(
            f"--compile-backend {backend}: nothing is compiled here (--fusion-impl auto runs "
            "eager off CUDA); add --compile-layers or --fusion-impl compile, or drop it"
        )
    if not cuda and (compile_fusions or config.compile_layers) and backend == "inductor":
        _require_cpu_compiler(
            "--compile-layers" if config.compile_layers else "--fusion-impl compile"
        )
    if config.attention_backend == "fused" and not cuda:
        raise ConfigError(
            "--attention-backend fused needs CUDA (cuDNN fused attention); use "
            "auto, flash or unfused on the CPU"
        )

    parts = {}
    if config.deterministic_mode:
        deterministic_environment()
        parts["mode"] = use_deterministic_algorithms()
    KERNELS.attention, parts["attention"] = _choose_attention(config, te, attention, device, dtype)
    apex = try_import("apex.normalization.fused_layer_norm") if cuda else None
    if not config.norm_fusion:
        parts["norm"] = f"eager {normalization}"
    elif apex is not None:
        norms = ApexNorms(apex)
        KERNELS.layer_norm, KERNELS.rms_norm = norms.layer_norm, norms.rms_norm
        parts["norm"] = f"apex fused {normalization}"
    else:
        KERNELS.layer_norm = fuse(reference.layer_norm)
        KERNELS.rms_norm = fuse(reference.rms_norm)
        parts["norm"] = f"{how} {normalization}"
    for names, enabled, label in (
        (("swiglu", "swiglu_stacked"), config.bias_swiglu_fusion, "SwiGLU"),
        (("gelu",), config.bias_gelu_fusion, "GELU"),
        (("rotary", "rotary_interleaved", "split_rotary"), config.apply_rope_fusion, "RoPE"),
    ):
        for name in names:
            kernel = getattr(reference, name)
            setattr(KERNELS, name, fuse(kernel) if enabled else kernel)
        parts[label] = how if enabled else "eager"
    if config.cross_entropy_loss_fusion:
        KERNELS.cross_entropy = functools.partial(
            fused_vocab_parallel_cross_entropy,
            chunk_tokens=config.cross_entropy_chunk_tokens,
            gradient=fuse(softmax_gradient),
            sums=fuse(sum_of_exponentials),
        )
        parts["cross-entropy"] = (
            f"chunked, {config.cross_entropy_chunk_tokens} tokens per chunk ({how})"
        )
    else:
        parts["cross-entropy"] = "reference (whole logits in fp32)"
    # (set either way: a process configures kernels once per run, tests many times)
    reduced = not config.disable_bf16_reduced_precision_matmul
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    if not reduced and dtype == torch.bfloat16:
        parts["bf16 GEMMs"] = "partial sums in fp32 (--disable-bf16-reduced-precision-matmul)"
    # apex's FusedAdam is not used even when present: PyTorch's fused AdamW is the same
    # multi-tensor kernel and keeps one optimizer-state format in checkpoints.
    parts["optimizer"] = "torch AdamW (fused kernel for unsharded fp32 masters)"
    if config.compile_layers:
        # (the FP8 linears inside or between them: the "> fp8:" line, model/fp8.py)
        parts["transformer layers"] = "each torch.compile'd as one graph" + (
            f" ({backend}: traced, run op by op)" if backend != "inductor" else ""
        )
    if in_fp8:
        for name in _FP8_CASTS:
            setattr(KERNELS, name, fuse(getattr(reference, name)))
        casts = f"casts with transposes and scales {how}"
        # One hand-written kernel per cast (and per amax) where Triton is: the compiled ones
        # took three to four launches each, and the launches bound an FP8 step on an H100.
        triton_fp8 = try_import("threefold.kernels.triton_fp8") if cuda else None
        if triton_fp8 is not None and config.fusion_impl == "auto":
            for name in _FP8_CASTS:
                setattr(KERNELS, name, getattr(triton_fp8, name))
            # and inside compiled layers too (fp8_ops.py says why; --fusion-impl compile
            # leaves them to Inductor)
            KERNELS.opaque_fp8_casts = True
            casts = (
                "casts with transposes, scales and amaxes Triton (one kernel each, "
                "opaque to compiled layers)"
            )
        parts["fp8 GEMMs"] = f"{_fp8_gemms(device, fp8.fp8_recipe, fp8.fp8)}, {casts}"
    # Inside compiled layers the forward flags the fused gradient for its backward, which
    # 1F1B's forward-before-backward order would mismatch (tensor_parallel/weight_grad.py).
    unflaggable = config.compile_layers and pipeline_parallel_size > 1
    fusable = config.gradient_accumulation_fusion and not unflaggable
    KERNELS.gradient_accumulation_fusion = fusable and _gradient_accumulation_fusion(device, dtype)
    if KERNELS.gradient_accumulation_fusion:
        parts["weight gradients"] = "accumulated into the gradient buffer by their GEMM"
    elif config.gradient_accumulation_fusion:
        why = (
            "this torch has no addmm with out_dtype"
            if fusable
            else "compiled layers under pipeline parallelism"
        )
        # (the FP8 layers add their fp32 weight gradients themselves: training/build.py)
        parts["weight gradients"] = f"added to the gradient buffer separately ({why})" + (
            "; the FP8 layers' accumulated by their GEMM" if in_fp8 else ""
        )
    KERNELS.description = f"transformer-impl {impl}; " + ", ".join(
        f"{key} {value}" for key, value in parts.items()
    )
    return f"> kernels: {KERNELS.description}"


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> None:
    """torch.compile each transformer layer of a model chunk in place, as torchtitan compiles
    its blocks: one graph per layer, so the compiler fuses across kernels (a residual add into
    the next norm, RoPE into the QKV split). Per layer rather than the whole model: every layer
    reuses one compiled graph, and pipeline stages, recomputation and FSDP keep their layer
    boundaries. Parameter names and state dicts are unchanged."""
    for layer in model.decoder.layers:
        layer.compile(backend=backend)


def configure_for_model(
    config: KernelConfig,
    model: ModelConfig,
    tensor_parallel_size: int,
    device: torch.device,
    dtype: torch.dtype,
    micro_batch_size: int = 1,
    fp8: Fp8Config | None = None,
    pipeline_parallel_size: int = 1,
    cp_comm_type: str | None = None,
) -> str:
    """`configure` for a model's attention shapes on one tensor-parallel rank; `cp_comm_type`
    the --cp-comm-type of a run with context parallelism (None: without)."""
    heads = model.num_attention_heads // tensor_parallel_size
    mla = model.multi_latent_attention  # one key/value head per query head, padded (model/mla.py)
    shape = AttentionShape(
        heads=heads,
        groups=heads if mla else model.num_query_groups // tensor_parallel_size,
        head_dim=max(model.q_head_dim, model.v_head_dim) if mla else model.kv_channels,
        dropout=model.attention_dropout,
        sequence=model.seq_length,
        batch=micro_batch_size,
    )
    if fp8 is not None and fp8.enabled and _on_gpu(device):
        check_fp8_shapes(model, tensor_parallel_size)
    line = configure(config, device, dtype, model.normalization, shape, fp8, pipeline_parallel_size)
    capped = model.attn_logit_softcapping is not None
    if cp_comm_type in ("p2p", "allgather", "a2a+p2p"):
        line += (
            f"; --cp-comm-type {cp_comm_type}: attention by blocks merged by log-sum-exp, on "
            + _blocks(shape, device, dtype, capped)
        )
    if model.sparse_attention:  # (model/dsa.py)
        line += (
            "; --experimental-attention-variant dsa: the attention above under a mask of each "
            "query's top-k keys (s x s, as megatron-core 0.16's unfused sparse attention)"
        )
    if model.softmax_type != "vanilla":  # (model/attention.py's SoftmaxOffsetAttention)
        line += (
            f"; --softmax-type {model.softmax_type}: attention as the context-parallel ring's "
            f"blocks, the sinks merged, on {_blocks(shape, device, dtype)}"
        )
    if capped:  # (model/attention.py's softcapped_attention)
        line += (
            "; --attn-logit-softcapping: attention as the context-parallel ring's blocks, "
            f"the scores capped, on {_blocks(shape, device, dtype, capped)}"
        )
    return line


_BLOCK_KERNELS = {
    "cpu flash": "PyTorch's CPU flash kernel",
    "cuda flash": "FlashAttention-2 (PyTorch's)",
    "math": "eager",
}


def _blocks(
    shape: AttentionShape, device: torch.device, dtype: torch.dtype, capped: bool = False
) -> str:
    """The kernel of the blocks that context-parallel attention merges by log-sum-exp (after
    `configure`: --deterministic-mode changes it on CUDA; capped scores run eager)."""
    probe = torch.empty(1, 1, 1, shape.head_dim, dtype=dtype, device=device)
    kernel = _BLOCK_KERNELS[block_kernel(probe, None, None, capped)]
    if kernel == "eager":
        return "eager blocks"
    return f"{kernel} (masked blocks, for documents or windows, and dropout: eager)"
