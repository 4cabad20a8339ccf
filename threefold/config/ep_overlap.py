"""--overlap-moe-expert-parallel-comm and --delay-wgrad-compute (Megatron-LM's expert-parallel
all-to-all overlap): the forward of one micro-batch runs together with the backward of another,
each one's all-to-alls travelling while the other computes
(parallel/pipeline_parallel/combined_1f1b.py).

`ParallelConfig` inherits the fields (Megatron-LM keeps them with its parallel settings);
`check_ep_overlap` is called from the run config's finalize, where the model and kernels are
known. The refusals are Megatron-LM's, but for the precision: the combined step computes in
any dtype, so an fp32 run (which Megatron-LM refuses) is taken. threefold adds one of its own:
layers compiled whole, whose graphs would run the exchanges the step hands over at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import arg

if TYPE_CHECKING:
    from threefold.config.run import Config

GROUP = "mixture of experts"
FLAG = "--overlap-moe-expert-parallel-comm"


@dataclass
class ExpertOverlapConfig:
    overlap_moe_expert_parallel_comm: bool = arg(
        False,
        group=GROUP,
        help="run each micro-batch's forward together with the previous one's backward, each "
        "one's expert-parallel all-to-alls travelling while the other computes (combined 1F1B)",
    )
    delay_wgrad_compute: bool = arg(
        False,
        group=GROUP,
        help="in a combined step's backward, compute the linear layers' weight gradients while "
        "the next all-to-all travels, not before it starts",
    )


def check_ep_overlap(config: Config) -> None:
    """The conditions on the combined step (Megatron-LM's, and threefold's own: module doc),
    each refused in one line."""
    model, parallel = config.model, config.parallel
    if parallel.delay_wgrad_compute:
        _require(
            parallel.overlap_moe_expert_parallel_comm,
            f"--delay-wgrad-compute delays weight gradients into the all-to-alls of {FLAG} "
            "(as Megatron-LM): add it",
        )
    if not parallel.overlap_moe_expert_parallel_comm:
        return
    _require(
        model.is_moe and parallel.expert_model_parallel_size > 1,
        f"{FLAG} overlaps the expert-parallel all-to-alls: it needs --num-experts and "
        "--expert-model-parallel-size > 1",
    )
    _require(
        model.moe_token_dispatcher_type == "alltoall",
        f"{FLAG} overlaps the alltoall dispatcher's exchanges: add "
        "--moe-token-dispatcher-type alltoall",
    )
    _require(
        parallel.pipeline_model_parallel_size == 1 or parallel.virtual_pipeline_model_parallel_size,
        f"{FLAG} with pipeline stages runs the interleaved schedule (as Megatron-LM): add "
        "--num-virtual-stages-per-pipeline-rank (or a --pipeline-model-parallel-layout with "
        "several chunks per stage)",
    )
    _require(
        model.recompute_granularity != "full",
        f"{FLAG} with full recomputation would exchange again inside the backward (as "
        "Megatron-LM, refused): use selective recomputation",
    )
    _require(
        not model.recomputes("moe"),
        f"{FLAG} with --recompute-modules moe would exchange again inside the backward (as "
        "Megatron-LM, refused): drop moe",
    )
    _require(
        not model.moe_shared_expert_overlap,
        f"{FLAG} and --moe-shared-expert-overlap both fill the all-to-alls' time (Megatron-LM "
        "takes one): drop one",
    )
    _require(
        (model.mtp_num_layers or 0) <= 1,
        f"{FLAG} takes at most one multi-token prediction layer (as Megatron-LM): "
        "--mtp-num-layers 1",
    )
    _require(
        not config.kernels.compile_layers,
        f"{FLAG} hands over at each exchange, which a layer compiled by --compile-layers "
        "runs inside its graph: drop one",
    )
