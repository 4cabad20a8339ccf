"""Activation recomputation's fields (Megatron's --recompute-granularity, -method, -num-layers,
-modules).

`full` recomputes whole layers (groups of them, or a stage's first ones). `selective`
recomputes the modules --recompute-modules names inside every layer (default: the core
attention), as megatron-core does:

    core_attn       the core attention (softmax(QK^T)V)
    mlp             a dense layer's MLP
    moe             an MoE layer's whole MLP (router, dispatch, experts, shared expert)
    shared_experts  an MoE layer's shared expert
    layernorm       the two norms of each layer           } output-discarding: the output is
    moe_act         the experts' activation function      } freed once its consumer has run,
    mla_up_proj     MLA's up projections and RoPE         } and recomputed before that
                                                          } consumer's backward

`ModelConfig` inherits the fields; `finalize_recompute` is called from its finalize, and
`check_recompute_kernels` from the run config's, where the kernel choice is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg

if TYPE_CHECKING:
    from threefold.config.run import Config

MODULES = (
    "core_attn",
    "mlp",
    "moe",
    "shared_experts",
    "layernorm",
    "moe_act",
    "mla_up_proj",
    "gdn_norm_out",
)
# Recomputed by freeing their outputs (model/recompute.py: OutputDiscardingCheckpoint).
OUTPUT_DISCARDING = ("layernorm", "moe_act", "mla_up_proj", "gdn_norm_out")
# megatron-core's modules of models threefold does not have (refused with those models' flags).
OTHER_MODELS = ("gdp_in_proj", "gdp_qkv", "mhc")


@dataclass
class RecomputeConfig:
    recompute_granularity: str | None = arg(
        None,
        help="full: recompute whole layers; selective: the --recompute-modules of every layer",
        choices=("full", "selective"),
    )
    recompute_method: str | None = arg(
        None,
        help=(
            "uniform: checkpoint groups of --recompute-num-layers layers; "
            "block: checkpoint the first --recompute-num-layers layers of "
            "each stage"
        ),
        choices=("uniform", "block"),
    )
    recompute_num_layers: int | None = arg(
        None,
        minimum=0,
        help="layers per recomputed group (uniform) or recomputed layers per stage (block)",
    )
    recompute_modules: list[str] | None = arg(
        None,
        nargs="*",
        metavar="MODULE",
        help=f"what --recompute-granularity selective recomputes, of {' '.join(MODULES)} "
        "(default: core_attn)",
    )

    moe_layer_recompute: bool = arg(
        False,
        help="deprecated (as in Megatron-LM): --recompute-granularity selective with moe added "
        "to --recompute-modules",
    )

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation takes `module` (one of MODULES)."""
        modules = self.recompute_modules
        chosen = ["core_attn"] if modules is None else modules  # (a config not finalized)
        return self.recompute_granularity == "selective" and module in chosen

    def finalize_recompute(self) -> list[str]:
        """Validate; returns notes to print. Needs the MoE and MLA fields finalized."""
        notes = self._moe_layer_recompute()
        granularity, method = self.recompute_granularity, self.recompute_method
        _require(
            granularity in (None, "full", "selective"),
            "--recompute-granularity must be full or selective",
        )
        notes += self._finalize_modules()
        if granularity == "full":
            _require(
                method in ("uniform", "block"),
                "--recompute-granularity full needs --recompute-method uniform or block",
            )
            _require(
                self.recompute_num_layers is not None and self.recompute_num_layers >= 1,
                "--recompute-granularity full needs --recompute-num-layers >= 1",
            )
        elif granularity == "selective":
            _require(
                method is None and self.recompute_num_layers is None,
                "--recompute-method and --recompute-num-layers need --recompute-granularity full",
            )
        elif method is not None or self.recompute_num_layers is not None:
            # Megatron-LM takes them without a granularity, and recomputes nothing.
            given = [
                flag
                for flag, value in (
                    ("--recompute-method", method),
                    ("--recompute-num-layers", self.recompute_num_layers),
                )
                if value is not None
            ]
            verb = "change" if len(given) > 1 else "changes"
            notes.append(
                f"{' and '.join(given)} {verb} nothing without --recompute-granularity full "
                "(as in Megatron-LM): nothing is recomputed"
            )
        return notes

    def _moe_layer_recompute(self) -> list[str]:
        """--moe-layer-recompute as megatron-core reads it: selective recomputation, with moe
        added to the modules (core_attn unless given)."""
        if not self.moe_layer_recompute:
            return []
        _require(
            self.recompute_granularity != "full",
            "--moe-layer-recompute with --recompute-granularity full (megatron-core refuses the "
            "pair); drop one",
        )
        self.recompute_granularity = "selective"
        modules = ["core_attn"] if self.recompute_modules is None else self.recompute_modules
        modules = self.recompute_modules = modules + ["moe"] * ("moe" not in modules)
        return [
            "--moe-layer-recompute is deprecated (as in Megatron-LM): it recomputes as "
            f"--recompute-granularity selective --recompute-modules {' '.join(modules)}"
        ]

    def _finalize_modules(self) -> list[str]:
        given = self.recompute_modules is not None
        modules = self.recompute_modules = (
            list(dict.fromkeys(self.recompute_modules)) if given else ["core_attn"]
        )
        others = [m for m in modules if m in OTHER_MODELS]
        _require(
            not others,
            f"--recompute-modules {' '.join(others)}: modules of models threefold does not have "
            "(gated delta products, hyper-connections); drop them",
        )
        unknown = [m for m in modules if m not in MODULES]
        _require(
            not unknown,
            f"--recompute-modules {' '.join(unknown)} unknown; choose from {' '.join(MODULES)}",
        )
        if given and self.recompute_granularity != "selective":
            # As in Megatron-LM, which reads them only under selective recomputation.
            return [
                "--recompute-modules changes nothing without --recompute-granularity "
                "selective (as in Megatron-LM)"
            ]
        if self.recompute_granularity != "selective":
            return []
        _require(
            "mla_up_proj" not in modules or self.multi_latent_attention,
            "--recompute-modules mla_up_proj recomputes multi-latent attention's up projections: "
            "add --multi-latent-attention or drop it",
        )
        _require(
            "mla_up_proj" not in modules or not (self.lora_rank and self.lora_dropout > 0),
            "--recompute-modules mla_up_proj reruns the up projections without their LoRA "
            "dropout's random state: drop --lora-dropout or mla_up_proj",
        )
        _require(
            "moe" not in modules or self.moe_router_load_balancing_type != "global_aux_loss",
            "--moe-router-load-balancing-type global_aux_loss counts each micro-batch once as "
            "it is routed, which --recompute-modules moe would route again; recompute "
            "moe_act or shared_experts, or use another load-balancing type",
        )
        notes = []
        if "moe" in modules and "shared_experts" in modules:
            notes.append(
                "--recompute-modules moe recomputes the shared expert with the rest of the MoE "
                "layer: shared_experts adds nothing"
            )
        idle = {
            "moe": not self.is_moe,
            "moe_act": not self.is_moe,
            "shared_experts": self.moe_shared_expert_intermediate_size is None,
            "gdn_norm_out": not self.gated_delta_net,
            "mlp": self.is_moe and all(self.moe_layer_pattern(self.num_layers)),
        }
        unused = [m for m in modules if idle.get(m)]
        if unused:
            notes.append(
                f"--recompute-modules {' '.join(unused)}: the model has no such module; nothing "
                "is recomputed for it"
            )
        return notes


def check_recompute_kernels(config: Config) -> None:
    """The output-discarding modules free tensors a compiled layer's graph would hold itself
    (its partitioner already recomputes cheap element-wise results such as norms and
    activations)."""
    model = config.model
    discarding = [m for m in OUTPUT_DISCARDING if model.recomputes(m)]
    _require(
        not (discarding and config.kernels.compile_layers),
        f"--recompute-modules {' '.join(discarding)} frees outputs inside the layer, which "
        "--compile-layers traces as one graph (whose backward recomputes norms and "
        "activations itself); drop one",
    )
