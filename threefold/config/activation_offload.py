"""Fine-grained activation offloading's fields (Megatron-LM's --fine-grained-activation-
offloading, --offload-modules and their tuning flags).

What each module named in --offload-modules keeps for backward moves to host memory at the
end of its forward and comes back before its backward (model/activation_offload.py):

    attn_norm    the attention's input norm        } each layer's; Megatron-LM's names
    qkv_linear   the query/key/value projections  }
    core_attn    the core attention                }
    attn_proj    the attention's output projection }
    mlp_norm     the MLP's input norm              }
    expert_fc1   the experts' first linear layer   } MoE layers
    moe_act      the experts' activation function  }
    fused_group_mlp  the experts' whole MLP        }

--cpu-offloading-num-layers N (Megatron-LM's layer-level offloading, which it runs through
Transformer Engine) offloads everything the first N transformer layers keep, a group per layer.

`ModelConfig` inherits the fields; `finalize_activation_offload` is called from its finalize,
and `check_offload_run` from the run config's, where the kernels and the layout are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg, given_flags

if TYPE_CHECKING:
    from threefold.config.run import Config

GROUP = "fine-grained activation offloading"
MODULES = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
    "fused_group_mlp",
)
EXPERT_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
# The fields of fine-grained offloading (the others: layer-level offloading's)
FINE_GRAINED = (
    "offload_modules",
    "min_offloaded_tensor_size",
    "activation_offload_fraction",
    "delta_offload_bytes_across_pp_ranks",
    "fine_grained_offloading_max_inflight_offloads",
)


@dataclass
class ActivationOffloadConfig:
    fine_grained_activation_offloading: bool = arg(
        False,
        group=GROUP,
        help="move what the --offload-modules keep for backward to host memory during the "
        "forward pass, and back before their backward",
    )
    offload_modules: list[str] | None = arg(
        None,
        nargs="*",
        metavar="MODULE",
        group=GROUP,
        help=f"whose saved activations are offloaded, of {' '.join(MODULES)}",
    )
    min_offloaded_tensor_size: int = arg(
        1024 * 1024, group=GROUP, help="elements below which a saved tensor stays on the device"
    )
    activation_offload_fraction: float = arg(
        1.0,
        group=GROUP,
        help="the share of a forward pass's offloadable modules offloaded, the earliest first",
    )
    delta_offload_bytes_across_pp_ranks: int = arg(
        0,
        group=GROUP,
        help="bytes each later pipeline stage keeps on the device beyond the one before it "
        "(later stages hold fewer micro-batches in flight)",
    )
    fine_grained_offloading_max_inflight_offloads: int | None = arg(
        None,
        group=GROUP,
        help="copies to the host in flight per module before the forward waits for the "
        "oldest (default: never waits)",
    )
    cpu_offloading_num_layers: int = arg(
        0,
        group=GROUP,
        help="offload the activations of the first N transformer layers (layer-level "
        "offloading; fewer than --num-layers)",
    )
    cpu_offloading_retain_pinned_cpu_buffers: bool = arg(
        False,
        group=GROUP,
        help="keep the pinned host buffers between iterations (PyTorch's pinned-memory cache "
        "keeps them either way)",
    )

    def offloads_layers(self) -> bool:
        """Whether --cpu-offloading-num-layers offloads whole layers."""
        return self.cpu_offloading_num_layers > 0

    def offloads(self, module: str) -> bool:
        """Whether fine-grained activation offloading takes `module` (one of MODULES)."""
        return self.fine_grained_activation_offloading and module in (self.offload_modules or ())

    def finalize_activation_offload(self) -> list[str]:
        """Validate; returns notes to print. Needs the MoE and recomputation fields
        finalized."""
        layers = self.cpu_offloading_num_layers
        _require(
            0 <= layers < self.num_layers,
            f"--cpu-offloading-num-layers {layers} must be at least 0 and fewer than "
            f"--num-layers {self.num_layers} (the last layers' backward comes first)",
        )
        _require(
            layers or not self.cpu_offloading_retain_pinned_cpu_buffers,
            "--cpu-offloading-retain-pinned-cpu-buffers belongs to --cpu-offloading-num-layers: "
            "add it or drop the flag",
        )
        if layers:
            _require(
                not self.fine_grained_activation_offloading,
                "--cpu-offloading-num-layers offloads whole layers and "
                "--fine-grained-activation-offloading modules inside them: give one",
            )
            _require(
                self.recompute_granularity is None,
                "--cpu-offloading-num-layers with activation recomputation (as in Megatron-LM, "
                "which refuses the pair): drop one, or offload modules with "
                "--fine-grained-activation-offloading beside the recomputation",
            )
            if self.cpu_offloading_retain_pinned_cpu_buffers:
                return [
                    "--cpu-offloading-retain-pinned-cpu-buffers has no effect: PyTorch's "
                    "pinned-memory cache keeps the host buffers between iterations either way"
                ]
        if not self.fine_grained_activation_offloading:
            tuning = given_flags(self, ActivationOffloadConfig, FINE_GRAINED)
            _require(
                not tuning,
                f"{' '.join(tuning)} tune fine-grained activation offloading: add "
                "--fine-grained-activation-offloading or drop them",
            )
            return []
        modules = self.offload_modules = list(dict.fromkeys(self.offload_modules or ()))
        _require(
            bool(modules),
            "--fine-grained-activation-offloading needs --offload-modules: some of "
            + " ".join(MODULES),
        )
        unknown = [m for m in modules if m not in MODULES]
        _require(
            not unknown,
            f"--offload-modules {' '.join(unknown)} unknown; choose from {' '.join(MODULES)}",
        )
        _require(
            "attn_proj" not in modules or "core_attn" in modules,
            "--offload-modules attn_proj needs core_attn too: the projection's input is the "
            "core attention's output, which the core keeps on the device for its own backward",
        )
        _require(
            "fused_group_mlp" not in modules or not {"expert_fc1", "moe_act"} & set(modules),
            "--offload-modules fused_group_mlp offloads the experts' whole MLP, expert_fc1 "
            "and moe_act included; give one or the others",
        )
        _require(self.min_offloaded_tensor_size >= 0, "--min-offloaded-tensor-size must be >= 0")
        _require(
            0.0 <= self.activation_offload_fraction <= 1.0,
            "--activation-offload-fraction must be in [0, 1]",
        )
        _require(
            self.delta_offload_bytes_across_pp_ranks >= 0,
            "--delta-offload-bytes-across-pp-ranks must be >= 0",
        )
        inflight = self.fine_grained_offloading_max_inflight_offloads
        _require(
            inflight is None or inflight >= 0,
            "--fine-grained-offloading-max-inflight-offloads must be >= 0",
        )
        inside_moe = [m for m in modules if m in EXPERT_MODULES]
        _require(
            not (inside_moe and self.recomputes("moe")),
            f"--offload-modules {' '.join(inside_moe)} with --recompute-modules moe, which "
            "keeps only the MoE layer's input: drop one",
        )
        notes = []
        if self.recompute_granularity == "full":
            notes.append(
                "--fine-grained-activation-offloading with --recompute-granularity full: the "
                "recomputed layers keep only their inputs, so their modules offload nothing"
            )
        if "core_attn" in modules and self.recomputes("core_attn"):
            notes.append(
                "--offload-modules core_attn with --recompute-modules core_attn: the core "
                "attention keeps only its inputs, which its recomputation holds"
            )
        if inside_moe and not self.is_moe:
            notes.append(
                f"--offload-modules {' '.join(inside_moe)}: the model has no experts; nothing "
                "is offloaded for them"
            )
        return notes


def offload_plan(sizes: list[int], fraction: float, keep_on_device_bytes: int) -> set[int]:
    """Which of a forward pass's groups (their saved bytes, in forward order) are offloaded:
    not the last (its backward comes first, so bringing it back could only stall) nor empty
    ones; the device keeps the latest worth `keep_on_device_bytes` (pp_rank x
    --delta-offload-bytes-across-pp-ranks), then the latest int(n x (1 - fraction)) of the n
    left (as megatron-core does after its warm-up step). The model (model/activation_offload.py)
    and the memory estimate plan alike."""
    eligible = [i for i, size in enumerate(sizes[:-1]) if size > 0]
    kept = set()
    for index in reversed(eligible):
        if keep_on_device_bytes <= 0:
            break
        kept.add(index)
        keep_on_device_bytes -= sizes[index]
    rest = [i for i in eligible if i not in kept]
    return set(rest[: len(rest) - int(len(rest) * (1 - fraction))])


def check_offload_run(config: Config) -> None:
    """Offloading acts on the tensors autograd saves in eager mode, which a compiled layer's
    graph keeps itself; layer-level offloading runs without pipeline stages (as in
    Megatron-LM, whose later stages hold fewer micro-batches)."""
    model = config.model
    flag = (
        "--fine-grained-activation-offloading"
        if model.fine_grained_activation_offloading
        else "--cpu-offloading-num-layers"
    )
    offloading = model.fine_grained_activation_offloading or model.offloads_layers()
    _require(
        not (offloading and config.kernels.compile_layers),
        f"{flag} moves the tensors saved by the layers' eager operations, which "
        "--compile-layers replaces with one graph that keeps its own; drop one",
    )
    _require(
        not model.offloads_layers() or config.parallel.pipeline_model_parallel_size == 1,
        "--cpu-offloading-num-layers runs without pipeline parallelism (as in Megatron-LM); "
        "offload modules with --fine-grained-activation-offloading instead",
    )
