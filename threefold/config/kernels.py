"""Which kernels a run asks for (Megatron-LM's fusion flags, plus threefold's --fusion-impl).

The flags say *what* may be fused; `threefold.kernels.dispatch` decides at start-up *how*,
from what imports and the device, and logs it. Every choice computes the same function as the
eager reference in `threefold.kernels.reference` (tests/kernels prove it).
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require
from threefold.config.fields import arg

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
FUSION_IMPLS = ("auto", "compile", "eager")
COMPILE_BACKENDS = ("inductor", "aot_eager")


@dataclass
class KernelConfig:
    # None: Transformer Engine when it imports and the run is on CUDA, else threefold's local
    # layers (Megatron-LM defaults to transformer_engine and fails without it).
    transformer_impl: str | None = arg(
        None,
        help="default: Transformer Engine's fused attention when it imports on CUDA, else local",
        choices=("local", "transformer_engine"),
    )
    # Megatron-LM's --deterministic-mode (kernels/determinism.py): bitwise-repeatable runs.
    deterministic_mode: bool = arg(
        False,
        help="bitwise-repeatable runs: deterministic kernels and attention backward, NCCL ring "
        "all-reduces (as Megatron-LM)",
    )
    # auto: SDPA picks (flash, cuDNN, memory-efficient, math); flash: FlashAttention; fused:
    # cuDNN fused attention (TE's when TE is used); unfused/local: the plain softmax(QK^T)V.
    attention_backend: str = arg(
        "auto",
        help=(
            "auto: the fastest SDPA kernel that runs the model's shapes; "
            "flash: FlashAttention; fused: cuDNN; unfused/local: plain "
            "softmax(QK^T)V"
        ),
        choices=ATTENTION_BACKENDS,
    )
    # How norms, SwiGLU/GELU, RoPE and the cross-entropy's elementwise work are fused when apex
    # or TE do not provide a kernel. auto: torch.compile on CUDA; eager on CPU, where the
    # compile time (seconds per process) is not repaid by a short run.
    fusion_impl: str = arg(
        "auto",
        help=(
            "how norms, SwiGLU/GELU, RoPE and cross-entropy chunks are fused "
            "when apex/TE do not: torch.compile or eager PyTorch (auto: "
            "compile on CUDA, eager on CPU)"
        ),
        choices=FUSION_IMPLS,
    )
    norm_fusion: bool = arg(
        True, flag="--no-norm-fusion", help="eager norms instead of apex / compiled kernels"
    )  # threefold's --no-norm-fusion (apex / compiled RMSNorm, LayerNorm)
    bias_swiglu_fusion: bool = arg(
        True, flag="--no-bias-swiglu-fusion", help="eager SwiGLU instead of a compiled kernel"
    )
    bias_gelu_fusion: bool = arg(
        True, flag="--no-bias-gelu-fusion", help="eager GELU instead of a compiled kernel"
    )
    apply_rope_fusion: bool = arg(
        True, flag="--no-rope-fusion", help="eager RoPE instead of a compiled kernel"
    )
    # The chunked cross-entropy (never the whole logits tensor in fp32). Megatron-LM's flag
    # turns it on; here it is the default (same function) and --no-cross-entropy-loss-fusion
    # selects the one-shot reference.
    cross_entropy_loss_fusion: bool = arg(
        True,
        help="the one-shot reference cross-entropy (whole logits in fp32)",
        flag="--no-cross-entropy-loss-fusion",
    )
    cross_entropy_chunk_tokens: int = arg(
        4096, minimum=1, help="tokens per chunk of the fused cross-entropy (default 4096)"
    )  # tokens per chunk of the fused cross-entropy
    # Megatron-LM's gradient-accumulation fusion (on by default there too): the weight-gradient
    # GEMM of the tensor-parallel linear layers adds into the fp32 gradient buffer itself
    # (its beta = 1) instead of writing a gradient that a separate kernel then adds.
    gradient_accumulation_fusion: bool = arg(
        True,
        flag="--no-gradient-accumulation-fusion",
        help="compute the linear layers' weight gradients and add them to the gradient buffer "
        "in separate kernels",
    )
    # Megatron-LM's: cuBLAS may add a bf16 GEMM's partial sums in bf16 for speed (torch's
    # allow_bf16_reduced_precision_reduction, on by default); this keeps them in fp32.
    disable_bf16_reduced_precision_matmul: bool = arg(
        False,
        help="bf16 GEMMs add their partial sums in fp32 throughout (cuBLAS may otherwise "
        "reduce in bf16)",
    )
    # torch.compile each transformer layer whole, as torchtitan compiles its blocks: the
    # kernels inside are traced into one graph, so --fusion-impl only affects the final norm
    # and the loss, which stay outside the layers.
    compile_layers: bool = arg(
        False,
        help=(
            "torch.compile each transformer layer as one graph (torchtitan's "
            "--compile): fuses across kernels (residual adds, norms, RoPE, "
            "SwiGLU); compile time is paid once per process"
        ),
    )
    # torchtitan's --compile.backend. aot_eager traces and differentiates the same graphs as
    # inductor (dynamo, AOTAutograd, the recomputation inside) and runs them op by op: what
    # tells a compiler's fault from the model's, and half the CPU time of the tests'
    # compiled-layer parity checks (tests/kernels/test_compile_layers.py keeps inductor's too).
    compile_backend: str = arg(
        "inductor",
        choices=COMPILE_BACKENDS,
        help="torch.compile's backend for --compile-layers and --fusion-impl compile: inductor "
        "generates fused kernels; aot_eager traces and differentiates the same graphs and runs "
        "them op by op (tells a compiler fault from a model fault)",
    )

    def finalize(self) -> None:
        # (--fusion-impl auto compiles on CUDA only: kernels/dispatch.py refuses it elsewhere)
        require(
            self.compile_backend == "inductor"
            or self.compile_layers
            or self.fusion_impl in ("auto", "compile"),
            f"--compile-backend {self.compile_backend} chooses torch.compile's backend: add "
            "--compile-layers or --fusion-impl compile, or drop it",
        )
        require(
            self.transformer_impl in (None, "local", "transformer_engine"),
            "--transformer-impl must be local or transformer_engine",
        )
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}",
        )
        require(
            self.fusion_impl in FUSION_IMPLS,
            f"--fusion-impl must be one of {', '.join(FUSION_IMPLS)}",
        )
