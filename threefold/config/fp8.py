"""FP8 training: Megatron-LM's --fp8-* flags (its TransformerConfig fields, same defaults).

The attention and MLP linear layers of the transformer layers (an MoE layer's shared expert;
its experts under rowwise scaling only) run their three GEMMs (forward, input gradient, weight
gradient) in FP8; embeddings, the output layer, norms, the attention core, MoE routers and
the tensor-parallel collectives stay in the run's precision (but sequence parallelism's input
all-gathers, in FP8 under tensorwise and delayed scaling). threefold.kernels.fp8 holds the
arithmetic, threefold.model.fp8 picks the layers.

    --fp8-format e4m3     every FP8 tensor in E4M3 (max 448)
    --fp8-format hybrid   activations and weights in E4M3, gradients in E5M2 (max 57344)
    --fp8-recipe delayed      each tensor's scale from the amax history of earlier steps
                              (Transformer Engine's DelayedScaling); the default, as Megatron-LM
    --fp8-recipe tensorwise   each tensor's scale from its own amax, computed just before the
                              cast (TE's Float8CurrentScaling, torchao's tensorwise)
    --fp8-recipe blockwise    a power-of-two scale per 1 x 128 block of each activation and
                              gradient in the layout its GEMM reads, per 128 x 128 block of
                              each weight (TE's Float8BlockScaling, DeepSeek-V3's recipe)
    --fp8-recipe rowwise      a power-of-two scale per row of each GEMM operand, from the row's
                              own amax (torchao's rowwise, torchtitan's
                              --float8.recipe_name rowwise; not a Megatron-LM recipe); the
                              one recipe that also puts MoE experts in FP8
    --fp8-param-gather        the FP8 layers' weights are cast once per step, from the
                              distributed optimizer's or FSDP2's fp32 shards, and all-gathered
                              as FP8 bytes (threefold.model.fp8_params, fp8_fsdp_params);
                              tensorwise, delayed, blockwise
    --no-fp8-wgrad            the weight gradients' GEMMs in the run's precision, from the
                              layer's input kept unquantized (Megatron-LM's fp8_wgrad=False,
                              Transformer Engine's override_linear_precision); the forward and
                              the input gradients stay in FP8
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require
from threefold.config.fields import arg, given_flags

FP8_FORMATS = ("e4m3", "hybrid")
# What Megatron-LM accepts (mxfp8 needs Blackwell's microscaling GEMMs), and torchao's
# rowwise.
FP8_RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")


# the layers kept in bf16: what a run without FP8 does anyway
_BF16_LAYERS = (
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
)


@dataclass
class Fp8Config:
    fp8: str | None = arg(
        None,
        flag="--fp8-format",
        help="train the transformer layers' linear GEMMs in FP8: e4m3 everywhere, or hybrid "
        "(E5M2 gradients)",
        choices=FP8_FORMATS,
    )
    fp8_recipe: str = arg(
        "delayed",
        help="delayed: scales from the amax history of earlier steps; tensorwise: from each "
        "tensor's own amax; blockwise: power-of-two scales per 1 x 128 block of activations and "
        "gradients, per 128 x 128 block of weights; rowwise: a power-of-two scale per row of each "
        "GEMM operand (torchao's)",
        choices=FP8_RECIPES,
    )
    fp8_margin: int = arg(0, help="scale = FP8 max / amax / 2^margin")
    fp8_amax_history_len: int = arg(1, minimum=1, help="steps of amax history (delayed scaling)")
    fp8_amax_compute_algo: str = arg(
        "most_recent",
        help="the amax a delayed scale uses: the newest in the history, or the history's max",
        choices=AMAX_COMPUTE_ALGOS,
    )
    fp8_param_gather: bool = arg(
        False,
        help="keep the FP8 layers' compute weights in FP8, cast from the distributed "
        "optimizer's (or FSDP2's) fp32 shards, and all-gather them in FP8",
    )
    # Megatron-LM applies it to delayed scaling only (the one recipe it passes TE's
    # override_linear_precision); here every recipe honours it.
    fp8_wgrad: bool = arg(
        True,
        flag="--no-fp8-wgrad",
        aliases=("--disable-fp8-wgrad",),
        help="compute the FP8 layers' weight gradients in the run's precision (their forward "
        "and input gradients stay in FP8); the layers then keep their inputs unquantized",
    )
    first_last_layers_bf16: bool = arg(
        False, help="keep the first and last transformer layers in the run's precision"
    )
    num_layers_at_start_in_bf16: int = arg(
        1, minimum=0, help="layers at the start kept out of FP8 with --first-last-layers-bf16"
    )
    num_layers_at_end_in_bf16: int = arg(
        1, minimum=0, help="layers at the end kept out of FP8 with --first-last-layers-bf16"
    )

    @property
    def enabled(self) -> bool:
        return self.fp8 is not None

    def bf16_layers(self, num_layers: int) -> frozenset[int]:
        """The 1-based layer numbers that stay out of FP8."""
        if not self.first_last_layers_bf16:
            return frozenset()
        start, end = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
        return frozenset(range(1, start + 1)) | frozenset(
            range(num_layers - end + 1, num_layers + 1)
        )

    def finalize(
        self,
        num_layers: int,
        fp16: bool,
        distributed_optimizer: bool,
        fsdp: bool = False,
        lora: bool = False,
    ) -> list[str]:
        """`distributed_optimizer`: threefold's own (--distributed-strategy megatron); `fsdp`:
        --distributed-strategy fsdp; `lora`: --lora-rank, every base weight frozen. Returns
        notes to print."""
        if not self.enabled:
            # Every FP8 setting: Megatron-LM drops them without --fp8-format. Only the layers
            # kept in bf16 come in its configs without it (Nemotron 3.5's, "all bf16" anyway):
            # said; the others, which would change nothing either, refused.
            kept = given_flags(self, Fp8Config, _BF16_LAYERS)
            given = [flag for flag in given_flags(self, Fp8Config) if flag not in kept]
            require(
                not given,
                f"{' and '.join(given)} belong{'s' if len(given) == 1 else ''} to FP8 training; "
                f"add --fp8-format e4m3 or hybrid, or drop {'it' if len(given) == 1 else 'them'}",
            )
            if kept:
                return [f"{' '.join(kept)}: no effect without --fp8-format (as in Megatron-LM)"]
            return []
        require(
            self.fp8_recipe != "mxfp8",
            "--fp8-recipe mxfp8: its microscaling GEMMs need Blackwell GPUs and Transformer "
            "Engine's kernels, which threefold does not call; use blockwise, delayed, "
            "tensorwise or rowwise",
        )
        require(
            not (self.fp8_param_gather and self.fp8_recipe == "rowwise"),
            "--fp8-param-gather all-gathers one FP8 copy of each weight, and rowwise scaling "
            "casts a weight twice (per row and per column); drop one, or pick tensorwise, "
            "delayed or blockwise",
        )
        require(not fp16, "--fp8-format with --fp16: FP8 training here runs beside --bf16")
        # (a scale divided by 2^128 or more is below fp32's range: every cast would be 0)
        require(
            0 <= self.fp8_margin <= 127,
            f"--fp8-margin {self.fp8_margin}: give 0 to 127 (the scale is FP8 max / amax / "
            "2^margin, and fp32 scales end at 2^-127)",
        )
        # (Megatron-LM takes it with FSDP2 too, and with TE >= 2.0 turns it off there;
        # torchtitan all-gathers FSDP2's shards in float8.)
        require(
            not self.fp8_param_gather or distributed_optimizer or fsdp,
            "--fp8-param-gather casts the distributed optimizer's or FSDP2's shards to FP8: "
            "add --use-distributed-optimizer with --distributed-strategy megatron, or use "
            "--distributed-strategy fsdp, or drop it",
        )
        # (the optimizer's and FSDP2's FP8 copies are of trained weights; a frozen one is cast
        # by its layer, and was said to be gathered in FP8 where nothing was)
        require(
            not (self.fp8_param_gather and lora),
            "--fp8-param-gather casts and all-gathers the FP8 layers' trained weights, and with "
            "--lora-rank every one of them is frozen: nothing would be gathered in FP8; drop "
            "--fp8-param-gather",
        )
        for flag, count in (
            ("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
            ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16),
        ):
            require(
                0 <= count <= num_layers,
                f"{flag} {count} must be between 0 and --num-layers {num_layers}",
            )
        return []


def experts_in_fp8(config: Fp8Config) -> bool:
    """Whether the MoE experts' linear layers run in FP8 (rowwise scaling only: module doc)."""
    return config.enabled and config.fp8_recipe == "rowwise"


def caches_fp8_weights(distributed_strategy: str) -> bool:
    """Whether a training step keeps its FP8 weights for all its micro-batches
    (`Fp8Scaling.weights_cached`). Not under FSDP, which gathers a layer's weights for its
    forward and frees them after: a copy of every layer's held through the step would undo
    that."""
    return distributed_strategy != "fsdp"


def traces_fp8_linears(
    compile_layers: bool, pipeline_parallel_size: int, param_gather: bool
) -> bool:
    """Whether FP8 linear layers are traced into their compiled layers' graphs
    (`Fp8Linear.linear`): under --compile-layers, except with pipeline parallelism (1F1B runs
    a micro-batch's forward before the previous one's backward) and --fp8-param-gather (whose
    weight copies a layer finds by the parameter's identity, which a graph would be
    specialized on: one graph per layer)."""
    return compile_layers and pipeline_parallel_size == 1 and not param_gather
