"""Which kernels a run asks for (Megatron-LM's fusion flags, plus threefold's --fusion-impl).

The flags say *what* may be fused; `threefold.kernels.dispatch` decides at start-up *how*,
from what imports and the device, and logs it. Every choice computes the same function as the
eager reference in `threefold.kernels.reference` (tests/kernels prove it).
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.errors import require

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
FUSION_IMPLS = ("auto", "compile", "eager")


@dataclass
class KernelConfig:
    # None: Transformer Engine when it imports and the run is on CUDA, else threefold's local
    # layers (Megatron-LM defaults to transformer_engine and fails without it).
    transformer_impl: str | None = None
    # auto: SDPA picks (flash, cuDNN, memory-efficient, math); flash: FlashAttention; fused:
    # cuDNN fused attention (TE's when TE is used); unfused/local: the plain softmax(QK^T)V.
    attention_backend: str = "auto"
    # How norms, SwiGLU/GELU, RoPE and the cross-entropy's elementwise work are fused when apex
    # or TE do not provide a kernel. auto: torch.compile on CUDA; eager on CPU, where the
    # compile time (seconds per process) is not repaid by a short run.
    fusion_impl: str = "auto"
    norm_fusion: bool = True  # threefold's --no-norm-fusion (apex / compiled RMSNorm, LayerNorm)
    bias_swiglu_fusion: bool = True
    bias_gelu_fusion: bool = True
    apply_rope_fusion: bool = True
    # The chunked cross-entropy (never the whole logits tensor in fp32). Megatron-LM's flag
    # turns it on; here it is the default (same function) and --no-cross-entropy-loss-fusion
    # selects the one-shot reference.
    cross_entropy_loss_fusion: bool = True
    cross_entropy_chunk_tokens: int = 4096  # tokens per chunk of the fused cross-entropy
    # torch.compile each transformer layer whole, as torchtitan compiles its blocks: the
    # kernels inside are traced into one graph, so --fusion-impl only affects the final norm
    # and the loss, which stay outside the layers.
    compile_layers: bool = False

    def finalize(self) -> None:
        require(self.transformer_impl in (None, "local", "transformer_engine"),
                "--transformer-impl must be local or transformer_engine")
        require(self.attention_backend in ATTENTION_BACKENDS,
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        require(self.fusion_impl in FUSION_IMPLS,
                f"--fusion-impl must be one of {', '.join(FUSION_IMPLS)}")
        require(self.cross_entropy_chunk_tokens >= 1,
                "--cross-entropy-chunk-tokens must be >= 1")
