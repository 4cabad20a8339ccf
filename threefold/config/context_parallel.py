"""Context parallelism's fields (Megatron's --context-parallel-size, --cp-comm-type,
--hierarchical-context-parallel-sizes).

`ParallelConfig` inherits them; `finalize_context_parallel` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg

if TYPE_CHECKING:
    from threefold.config.model import ModelConfig

# Megatron's --cp-comm-type names.
CP_COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")


@dataclass
class ContextParallelConfig:
    context_parallel_size: int = arg(
        1,
        help=(
            "CP: ranks that split every sequence (2 x CP load-balanced chunks, rank r holding "
            "chunks r and 2CP-1-r); attention exchanges keys/values by --cp-comm-type"
        ),
    )
    cp_comm_type: list[str] = arg(
        default_factory=lambda: ["p2p"],
        help=(
            "how CP ranks exchange attention inputs: p2p (ring attention, sends overlapped "
            "with each block's attention), allgather (all keys/values gathered), a2a (Ulysses: "
            "all-to-all from sequence- to head-sharded), a2a+p2p (Ulysses within groups of "
            "consecutive CP ranks, ring attention across them: "
            "--hierarchical-context-parallel-sizes)"
        ),
        nargs="+",
        choices=CP_COMM_TYPES,
    )
    hierarchical_context_parallel_sizes: list[int] | None = arg(
        None,
        help="a2a+p2p: the all-to-all group size (consecutive CP ranks), then the ring's; "
        "their product is --context-parallel-size",
        nargs="+",
    )

    @property
    def comm_type(self) -> str:
        """The one --cp-comm-type of every layer."""
        return self.cp_comm_type[0]

    @property
    def cp_a2a_size(self) -> int:
        """The Ulysses all-to-all's group: CP itself under a2a, its inner level under a2a+p2p,
        1 otherwise."""
        if self.comm_type == "a2a":
            return self.context_parallel_size
        sizes = self.hierarchical_context_parallel_sizes
        return sizes[0] if self.comm_type == "a2a+p2p" and sizes else 1

    def finalize_context_parallel(self, model: ModelConfig) -> None:
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        _require(cp >= 1, "--context-parallel-size must be >= 1")
        _require(
            self.world_size % (tp * self.pipeline_model_parallel_size * cp) == 0,
            f"world size {self.world_size} is not divisible by TP x PP x "
            f"--context-parallel-size {cp}; launch a multiple of "
            f"{tp * self.pipeline_model_parallel_size * cp} processes",
        )
        _require(
            len(set(self.cp_comm_type)) == 1,
            "--cp-comm-type takes one type for every layer here (per-layer types are not "
            "implemented); give one of p2p, allgather, a2a, a2a+p2p",
        )
        self._finalize_hierarchical()
        if cp == 1:
            return
        if model.gated_delta_net:  # each CP rank runs the rule for a share of the heads
            for name in ("linear_num_key_heads", "linear_num_value_heads"):
                heads = getattr(model, name)
                _require(
                    heads % (tp * cp) == 0,
                    f"--{name.replace('_', '-')} {heads} is not divisible by TP x "
                    f"--context-parallel-size {tp * cp}; each rank runs whole gated delta net "
                    "heads of the whole sequence",
                )
        # and the scan for a share of its heads
        if model.hybrid and "M" in model.hybrid_layers_with_mtp():
            for name, count in (("heads", model.mamba_heads()), ("groups", model.mamba_num_groups)):
                _require(
                    count % (tp * cp) == 0,
                    f"the {count} Mamba {name} are not divisible by TP x --context-parallel-size "
                    f"{tp * cp}; each rank scans whole heads and groups of the whole sequence",
                )
        _require(
            model.seq_length % (2 * cp) == 0,
            f"--seq-length {model.seq_length} is not divisible by 2 x --context-parallel-size "
            f"{cp} (each CP rank holds two of 2 x CP equal chunks)",
        )
        if self.sequence_parallel:
            _require(
                (model.seq_length // cp) % tp == 0,
                f"--seq-length {model.seq_length} / --context-parallel-size {cp} is not "
                f"divisible by --tensor-model-parallel-size {tp}, which --sequence-parallel "
                "needs",
            )
        a2a = self.cp_a2a_size
        if a2a > 1:
            heads, groups = model.num_attention_heads // tp, model.num_query_groups // tp
            what = "--context-parallel-size" if self.comm_type == "a2a" else "the all-to-all's"
            _require(
                heads % a2a == 0 and groups % a2a == 0,
                f"--cp-comm-type {self.comm_type} splits each TP rank's {heads} heads and "
                f"{groups} query groups over {what} {a2a} ranks, which must divide both; use "
                "--cp-comm-type p2p or allgather",
            )

    def _finalize_hierarchical(self) -> None:
        sizes, cp = self.hierarchical_context_parallel_sizes, self.context_parallel_size
        if self.comm_type != "a2a+p2p":
            _require(
                sizes is None,
                "--hierarchical-context-parallel-sizes shapes --cp-comm-type a2a+p2p; add it "
                "or drop them",
            )
            return
        _require(
            sizes is not None and len(sizes) == 2,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P: the "
            "all-to-all's group size, then the ring's",
        )
        _require(
            prod(sizes) == cp and min(sizes) >= 1,
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must multiply "
            f"to --context-parallel-size {cp}",
        )
