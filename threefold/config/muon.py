"""The optimizer choice and Muon's fields (Megatron-LM's --optimizer muon, --muon-*).

Muon steps every weight matrix of the transformer layers with momentum whose update is
orthogonalized by a Newton-Schulz iteration (training/muon.py); the embeddings, the output
layer, norms and biases stay with Adam (`--muon-scalar-optimizer adam`), as in Megatron-LM.

`TrainingConfig` inherits the fields; `finalize_muon` is called from its finalize, and
`check_muon_layout` from the run config's, where the parallel layout is known. Under
--use-distributed-optimizer each Muon matrix lies whole in one data-parallel rank's shard
(Megatron-LM's layer-wise distributed optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg

if TYPE_CHECKING:
    from threefold.config.run import Config

GROUP = "Muon optimizer"
OPTIMIZERS = ("adam", "muon")
# Newton-Schulz coefficient sets threefold has (training/muon.py), by Megatron-LM's names.
COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "cubic5")


@dataclass
class MuonConfig:
    optimizer: str = arg(
        "adam",
        help="adam (AdamW: decoupled weight decay, as Megatron-LM's adam) or muon (weight "
        "matrices orthogonalized, the rest Adam)",
    )
    muon_momentum: float = arg(0.9, group=GROUP, minimum=0, help="Muon's momentum")
    muon_split_qkv: bool = arg(
        True,
        flag="--muon-no-split-qkv",
        group=GROUP,
        help="orthogonalize the fused query/key/value weight whole, not each part apart",
    )
    muon_nesterov: bool = arg(False, group=GROUP, help="Nesterov momentum")
    muon_scale_mode: str = arg(
        "spectral",
        choices=("spectral", "unit_rms_norm", "shape_scaling"),
        group=GROUP,
        help="the update's scale: sqrt(max(out, in)), sqrt(out/in) or sqrt(max(1, out/in))",
    )
    muon_fp32_matmul_prec: str = arg(
        "medium",
        choices=("low", "medium", "high"),
        group=GROUP,
        help="Newton-Schulz matmuls: medium in bf16, high in fp32 (TF32 on GPUs)",
    )
    muon_coefficient_type: str = arg(
        "quintic", group=GROUP, help=f"Newton-Schulz coefficients: {', '.join(COEFFICIENT_TYPES)}"
    )
    muon_num_ns_steps: int = arg(5, group=GROUP, minimum=1, help="Newton-Schulz iterations")
    muon_tp_mode: str = arg(
        "duplicated",
        choices=("blockwise", "duplicated", "distributed"),
        group=GROUP,
        help="a TP-split matrix: duplicated gathers it and orthogonalizes it whole on every TP "
        "rank, blockwise orthogonalizes each rank's shard alone",
    )
    muon_use_syrk: bool = arg(
        False, group=GROUP, help="Megatron-LM's Triton SYRK Gram kernel (not in threefold)"
    )
    muon_extra_scale_factor: float = arg(
        1.0, group=GROUP, minimum=0, help="a further factor on the update"
    )
    use_layer_wise_param_layout: bool = arg(
        True,
        flag="--no-use-layer-wise-param-layout",
        group=GROUP,
        help="Megatron-LM's buffer layout choice for Muon under the distributed optimizer; "
        "threefold keeps each parameter whole in one rank's shard either way",
    )
    muon_scalar_optimizer: str = arg(
        "adam",
        choices=("adam", "lion"),
        group=GROUP,
        help="the optimizer of embeddings, output layer, norms and biases",
    )

    def finalize_muon(self) -> None:
        _require(
            self.optimizer in OPTIMIZERS,
            f"--optimizer {self.optimizer} is not built; threefold has {' and '.join(OPTIMIZERS)}",
        )
        if self.optimizer != "muon":
            return
        _require(
            self.muon_coefficient_type in COEFFICIENT_TYPES,
            f"--muon-coefficient-type {self.muon_coefficient_type} is not built; choose one of "
            f"{', '.join(COEFFICIENT_TYPES)}",
        )
        _require(
            self.muon_coefficient_type != "cubic5" or self.muon_num_ns_steps == 5,
            "--muon-coefficient-type cubic5 is a schedule of five steps: --muon-num-ns-steps 5",
        )
        _require(0 <= self.muon_momentum < 1, "--muon-momentum must be in [0, 1)")
        _require(
            self.muon_fp32_matmul_prec != "low",
            "--muon-fp32-matmul-prec low is not a precision torch has; use medium (bf16 "
            "Newton-Schulz) or high (fp32)",
        )
        _require(
            self.muon_tp_mode != "distributed",
            "--muon-tp-mode distributed (Newton-Schulz split over the TP ranks) is not built; "
            "duplicated gives the same updates",
        )
        _require(
            not self.muon_use_syrk,
            "--muon-use-syrk (Megatron-LM's Triton SYRK kernel) is not built; drop it",
        )
        _require(
            self.muon_scalar_optimizer == "adam",
            "--muon-scalar-optimizer lion is not built; threefold's scalar optimizer is adam",
        )


def check_muon_layout(config: Config) -> list[str]:
    """Muon beside the rest of the run (a `Config`): Megatron-LM's deprecated dist_muon is
    muon with the distributed optimizer. Returns start-up notes."""
    training, parallel = config.training, config.parallel
    notes = []
    if training.optimizer == "dist_muon":
        training.optimizer, parallel.use_distributed_optimizer = "muon", True
        notes.append("--optimizer dist_muon is --optimizer muon --use-distributed-optimizer")
    if training.optimizer != "muon":
        return notes
    _require(
        parallel.distributed_strategy == "megatron",
        "--optimizer muon runs with --distributed-strategy megatron (its own data parallelism)",
    )
    _require(
        not training.optimizer_cpu_offload,
        "--optimizer muon with --optimizer-cpu-offload is not built",
    )
    _require(
        not training.fp16,
        "--optimizer muon with --fp16 is not supported (as in Megatron-LM); use --bf16",
    )
    _require(
        not config.fp8.fp8_param_gather,
        "--optimizer muon with --fp8-param-gather is not built; drop --fp8-param-gather",
    )
    if not training.use_layer_wise_param_layout:
        notes.append(
            "--no-use-layer-wise-param-layout: threefold's distributed optimizer keeps every "
            "parameter whole in one rank's shard under Muon either way (the same steps)"
        )
    return notes
