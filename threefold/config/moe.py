"""Mixture-of-experts fields of the model (Megatron's --num-experts and --moe-* flags).

`ModelConfig` inherits them, so a checkpoint carries them like any other model field and a flag
is still declared once, here. `finalize_moe` is called from the model's own finalize.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, MODEL, arg, given_flags

if TYPE_CHECKING:
    from threefold.config.run import Config

GROUP = "mixture of experts"
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
# Megatron's --moe-layer-freq pattern, "([0]*1+[1]*3)": read by this, never evaluated.
_PATTERN_TERM = re.compile(r"^\[\s*([01])\s*\](?:\s*\*\s*(\d+))?$")
# ... and the whole sum repeated, "([1]*3+[0]*1)*2"
_REPEATED = re.compile(r"^\((.*)\)\s*\*\s*(\d+)$")


def every_nth_layer(every: int, num_layers: int, flag: str) -> list[int]:
    """1 for layers N, 2N, ... (numbered from 1), 0 for the others: --no-rope-freq N's
    layers, --window-attn-skip-freq N's full-attention ones."""
    _require(every >= 1, f"{flag} must be >= 1")
    return [int(number % every == 0) for number in range(1, num_layers + 1)]


def parse_layer_pattern(text: str, num_layers: int, flag: str = "--moe-layer-freq") -> list[int]:
    """--moe-layer-freq as one 0/1 per layer: N (every N-th layer, from the first, is MoE),
    a list "[1,0,1,0]", or Megatron's "([0]*1+[1]*3)" sums of repeated one-element lists, the
    sum itself repeated "(...)*k"; the lists of another `flag` (--linear-attention-freq) alike."""
    text = text.strip()
    wrapped = re.fullmatch(r"\(\s*(\[[^]]*\]\s*\*\s*\d+)\s*\)", text)
    if wrapped:  # ([0,1]*24), Llama 4 Maverick's
        text = wrapped.group(1)
    if re.fullmatch(r"\[[^]]*\]\s*\*\s*\d+", text):  # [1,0]*4, as Python reads it
        text = "(" + text.replace("]", "])", 1)
    repeated = _REPEATED.match(text)
    if repeated is not None:
        times = int(repeated.group(2))
        _require(
            times >= 1 and num_layers % times == 0,
            f"{flag} {text}: {times} repeats do not make --num-layers {num_layers}",
        )
        return parse_layer_pattern(f"({repeated.group(1)})", num_layers // times, flag) * times
    if text.isdigit():
        every = int(text)
        _require(every >= 1, f"{flag} must be >= 1")
        return [int(i % every == 0) for i in range(num_layers)]
    body = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    if body.startswith("[") and "*" not in body and body.count("[") == 1:
        items = [item.strip() for item in body.strip("[]").split(",") if item.strip()]
        pattern = [int(item) for item in items if item in ("0", "1")]
        _require(len(pattern) == len(items), f"{flag} {text}: the list may hold 0 and 1 only")
    else:
        pattern = []
        for term in body.split("+"):
            match = _PATTERN_TERM.match(term.strip())
            _require(match is not None, f"{flag} {text}: expected N, [1,0,...] or ([0]*a+[1]*b)")
            pattern += [int(match.group(1))] * int(match.group(2) or 1)
    _require(
        len(pattern) == num_layers,
        f"{flag} {text} gives {len(pattern)} layers, --num-layers is {num_layers}",
    )
    return pattern


@dataclass
class MoEConfig:
    num_experts: int | None = arg(
        None, checkpoint=ARCHITECTURE, group=GROUP, help="experts per MoE layer (none: dense)"
    )
    moe_ffn_hidden_size: int | None = arg(
        None, checkpoint=ARCHITECTURE, group=GROUP, help="each expert's hidden size"
    )
    moe_router_topk: int = arg(2, checkpoint=ARCHITECTURE, group=GROUP, help="experts per token")
    moe_router_score_function: str = arg(
        "softmax",
        checkpoint=ARCHITECTURE,
        group=GROUP,
        choices=("softmax", "sigmoid"),
        help="softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3) router scores",
    )
    moe_router_pre_softmax: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="softmax over all experts before the top-k (default: over the top-k logits)",
    )
    moe_router_load_balancing_type: str = arg(
        "aux_loss",
        checkpoint=MODEL,
        group=GROUP,
        choices=LOAD_BALANCING_TYPES,
        help="aux_loss (over the micro-batch), seq_aux_loss (per sequence), global_aux_loss "
        "(over every replica's micro-batches of the step so far), sinkhorn (balanced "
        "routing, no loss) or none",
    )
    moe_router_dtype: str | None = arg(
        None,
        group=GROUP,
        choices=("fp32", "fp64"),
        help="compute the router's logits and probabilities, and the weighted sum of the "
        "experts' outputs, in fp32 or fp64 (default: the run's dtype)",
    )
    moe_aux_loss_coeff: float = arg(
        0.0, checkpoint=MODEL, group=GROUP, help="weight of the load-balancing loss"
    )
    moe_z_loss_coeff: float | None = arg(
        None, checkpoint=MODEL, group=GROUP, help="weight of the router z-loss (ST-MoE)"
    )
    moe_shared_expert_intermediate_size: int | None = arg(
        None,
        minimum=1,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="hidden size of the shared expert every token also passes through (none: none)",
    )
    moe_latent_size: int | None = arg(
        None,
        minimum=1,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="latent mixture of experts (Nemotron 3 Super's): the routed experts work at this "
        "width, a projection down before the dispatch and up after the combine (the router "
        "and shared expert at the hidden size)",
    )
    moe_shared_expert_gate: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="scale the shared expert's output per token by a learned sigmoid gate",
    )
    # DeepSeek-V2/V3's group-limited routing (megatron-core's group_limited_topk)
    moe_router_num_groups: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="split the experts into this many equal groups (EP ranks or nodes) for "
        "--moe-router-group-topk",
    )
    moe_router_group_topk: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="route each token within its best groups only (a group's score: the sum of its "
        "top topk / group-topk expert scores)",
    )
    moe_router_topk_scaling_factor: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="multiply the routing probabilities by this (DeepSeek-V3: 2.5)",
    )
    moe_router_enable_expert_bias: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the sigmoid "
        "scores that choose the experts (not on the weights), nudged after each step towards "
        "an even load",
    )
    moe_router_bias_update_rate: float = arg(
        1e-3, group=GROUP, help="how far each step moves an expert's bias (sign of its deficit)"
    )
    moe_layer_freq: str = arg(
        "1",
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="which layers are MoE: every N-th, or a pattern like ([0]*1+[1]*3)",
    )
    moe_apply_probs_on_input: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        aliases=("--export-moe-apply-probs-on-input",),
        help="scale each token by its routing weight before its expert rather than the "
        "expert's output after it (Llama 4's; top-1 routing only)",
    )
    moe_expert_capacity_factor: float | None = arg(
        None,
        checkpoint=MODEL,
        group=GROUP,
        help="tokens an expert takes, as a multiple of an even share; excess dropped "
        "(none: dropless)",
    )
    moe_token_drop_policy: str = arg(
        "probs",
        checkpoint=MODEL,
        group=GROUP,
        choices=("probs", "position"),
        help="with a capacity: drop the lowest-probability tokens, or the latest ones",
    )
    moe_pad_expert_input_to_capacity: bool = arg(
        False, checkpoint=MODEL, group=GROUP, help="pad every expert's input to its capacity"
    )
    moe_token_dispatcher_type: str = arg(
        "allgather",
        group=GROUP,
        choices=("alltoall", "allgather", "flex"),
        help="how tokens reach their experts' ranks: all-to-all, or all-gather over EP (flex, "
        "Megatron-LM's DeepEP/HybridEP kernels, runs as alltoall)",
    )
    moe_flex_dispatcher_backend: str | None = arg(
        None,
        group=GROUP,
        choices=("deepep", "hybridep"),
        help="flex's CUDA library in Megatron-LM (default deepep); here flex runs as alltoall "
        "with either",
    )
    moe_use_upcycling: bool = arg(
        False,
        group=GROUP,
        help="start from --load's dense checkpoint, its MLPs turned into the experts, written "
        "to --save first (threefold/checkpoint/upcycling.py)",
    )
    moe_upcycling_granularity: int = arg(
        1,
        group=GROUP,
        minimum=1,
        help="with --moe-use-upcycling: the dense --ffn-hidden-size over --moe-ffn-hidden-size "
        "(each expert a piece of the dense MLP)",
    )
    moe_router_force_load_balancing: bool = arg(
        False,
        group=GROUP,
        help="benchmarking only (as in Megatron-LM): route by random logits, so the experts' "
        "loads are even; the router's gradient passes straight through them",
    )
    moe_shared_expert_overlap: bool = arg(
        False,
        group=GROUP,
        help="run the shared expert while the alltoall dispatcher's all-to-alls travel (after "
        "the router, not before it)",
    )
    moe_grouped_gemm: bool = arg(
        False,
        group=GROUP,
        help="all local experts in one grouped GEMM (torch._grouped_mm on CUDA bf16; elsewhere "
        "a padded batched matmul, slower than the default loop on the CPU)",
    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layer_pattern(self, num_layers: int) -> list[int]:
        """1 for each layer whose MLP is a mixture of experts."""
        if not self.is_moe:
            return [0] * num_layers
        return parse_layer_pattern(self.moe_layer_freq, num_layers)

    def _flex_as_alltoall(self) -> list[str]:
        """Megatron-LM's flex dispatcher (DeepEP's or HybridEP's CUDA kernels, which make the
        all-to-all exchange of the same tokens) as alltoall, said at start-up."""
        backend = self.moe_flex_dispatcher_backend
        if self.moe_token_dispatcher_type != "flex":
            _require(
                backend is None,
                f"--moe-flex-dispatcher-backend {backend} belongs to --moe-token-dispatcher-type "
                "flex; add it or drop the flag",
            )
            return []
        self.moe_token_dispatcher_type, self.moe_flex_dispatcher_backend = "alltoall", None
        return [
            f"--moe-token-dispatcher-type flex ({backend or 'deepep'}) runs as alltoall: DeepEP's "
            "and HybridEP's kernels are CUDA libraries that make the same exchange"
        ]

    def finalize_moe(self, num_layers: int, ffn_hidden_size: int) -> list[str]:
        """Validate; returns warnings to print."""
        if not self.is_moe:
            given = given_flags(self, MoEConfig)
            _require(
                not given,
                f"{' '.join(given)}: mixture-of-experts settings of a model without experts; "
                "add --num-experts or drop them",
            )
            return []
        _require(
            self.moe_router_load_balancing_type != "global_aux_loss"
            or self.recompute_granularity != "full",
            "--moe-router-load-balancing-type global_aux_loss counts each micro-batch once as "
            "it is routed, which full recomputation would route again; use selective "
            "recomputation or another load-balancing type",
        )
        notes = self._flex_as_alltoall()
        experts, topk = self.num_experts, self.moe_router_topk
        _require(experts >= 1, "--num-experts must be >= 1")
        _require(
            1 <= topk <= experts,
            f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}",
        )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = ffn_hidden_size
        _require(self.moe_ffn_hidden_size >= 1, "--moe-ffn-hidden-size must be >= 1")
        _require(
            not self.moe_shared_expert_gate or self.moe_shared_expert_intermediate_size,
            "--moe-shared-expert-gate gates the shared expert: add "
            "--moe-shared-expert-intermediate-size or drop it",
        )
        overlap = self.moe_shared_expert_overlap
        _require(
            not overlap or self.moe_shared_expert_intermediate_size,
            "--moe-shared-expert-overlap overlaps the shared expert with the dispatch: add "
            "--moe-shared-expert-intermediate-size or drop it",
        )
        _require(
            not overlap or self.moe_token_dispatcher_type == "alltoall",
            "--moe-shared-expert-overlap overlaps the alltoall dispatcher's all-to-alls (as in "
            "Megatron-LM): add --moe-token-dispatcher-type alltoall",
        )
        _require(
            not overlap or not self.recomputes("shared_experts"),
            "--moe-shared-expert-overlap runs the shared expert in two parts beside the "
            "all-to-alls, which --recompute-modules shared_experts cannot recompute (as in "
            "Megatron-LM): drop one",
        )
        _require(
            self.moe_router_load_balancing_type in LOAD_BALANCING_TYPES,
            f"--moe-router-load-balancing-type must be one of {', '.join(LOAD_BALANCING_TYPES)}",
        )
        _require(self.moe_aux_loss_coeff >= 0, "--moe-aux-loss-coeff must be >= 0")
        _require(
            self.moe_router_load_balancing_type != "sinkhorn" or not self.moe_aux_loss_coeff,
            "--moe-router-load-balancing-type sinkhorn balances by routing and takes no "
            "auxiliary loss: drop --moe-aux-loss-coeff (or set it to 0)",
        )
        _require(
            self.moe_z_loss_coeff is None or self.moe_z_loss_coeff >= 0,
            "--moe-z-loss-coeff must be >= 0",
        )
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        _require(
            (groups is None) == (group_topk is None),
            "--moe-router-num-groups and --moe-router-group-topk go together",
        )
        if groups is not None:
            _require(
                groups >= 1 and experts % groups == 0 and 1 <= group_topk <= groups,
                f"--moe-router-num-groups {groups} must divide --num-experts {experts}, and "
                f"--moe-router-group-topk {group_topk} be between 1 and it",
            )
            _require(
                topk % group_topk == 0 and topk // group_topk <= experts // groups,
                f"--moe-router-topk {topk} must be a multiple of --moe-router-group-topk "
                f"{group_topk}, at most {experts // groups} experts per group",
            )
            _require(
                self.moe_router_load_balancing_type != "sinkhorn",
                "--moe-router-group-topk routes by the top-k scores; sinkhorn routing does not",
            )
        _require(
            not self.moe_router_enable_expert_bias or self.moe_router_score_function == "sigmoid",
            "--moe-router-enable-expert-bias biases sigmoid scores: add "
            "--moe-router-score-function sigmoid",
        )
        _require(
            self.moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate must be >= 0"
        )
        capacity = self.moe_expert_capacity_factor
        _require(capacity is None or capacity > 0, "--moe-expert-capacity-factor must be positive")
        _require(
            not self.moe_pad_expert_input_to_capacity or capacity is not None,
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
        )
        _require(
            not self.moe_apply_probs_on_input or topk == 1,
            f"--moe-apply-probs-on-input scales a token's one expert input: it needs "
            f"--moe-router-topk 1, not {topk} (as in megatron-core)",
        )
        _require(
            any(self.moe_layer_pattern(num_layers)),
            f"--moe-layer-freq {self.moe_layer_freq} makes no layer an MoE layer",
        )
        if self.moe_router_force_load_balancing:
            notes.append(
                "--moe-router-force-load-balancing routes by random logits (as Megatron-LM, for "
                "benchmarking): the experts' loads are even and the routing learns nothing"
            )
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            # Megatron-LM takes it and routes by sigmoid scores all the same (its configs do).
            notes.append(
                "--moe-router-pre-softmax has no effect with --moe-router-score-function "
                f"{self.moe_router_score_function} (as in Megatron-LM)"
            )
        return notes


def check_upcycling(config: Config) -> list[str]:
    """--moe-use-upcycling's run: a dense --load to start from, a fresh --save to write the
    upcycled model to, and a mixture megatron-core's upcycling can fill. Returns notes."""
    model, checkpoint = config.model, config.checkpoint
    if not model.moe_use_upcycling:
        _require(
            model.moe_upcycling_granularity == 1,
            "--moe-upcycling-granularity shapes --moe-use-upcycling; add it or drop the flag",
        )
        return []
    granularity = model.moe_upcycling_granularity
    _require(
        model.is_moe, "--moe-use-upcycling turns a dense model into experts: add --num-experts"
    )
    _require(
        checkpoint.load and checkpoint.save and checkpoint.load != checkpoint.save,
        "--moe-use-upcycling reads the dense model from --load and writes the upcycled one to "
        "--save: give both, apart",
    )
    _require(
        model.num_experts % granularity == 0,
        f"--num-experts {model.num_experts} must be a multiple of --moe-upcycling-granularity "
        f"{granularity} (as in megatron-core)",
    )
    _require(
        model.moe_shared_expert_intermediate_size is None,
        "--moe-use-upcycling with a shared expert: megatron-core's upcycling leaves it at its "
        "initialization, the model no longer the dense one; drop "
        "--moe-shared-expert-intermediate-size",
    )
    _require(
        model.moe_latent_size is None,
        "--moe-use-upcycling with --moe-latent-size: the dense MLPs work at the hidden size, "
        "latent experts at another; drop one",
    )
    _require(
        not (model.quick_geglu or model.openai_gelu),
        "--moe-use-upcycling scales SwiGLU, GELU and squared-ReLU MLPs (megatron-core's); this "
        "model's activation is none of them",
    )
    notes = []
    if not (checkpoint.no_load_optim and checkpoint.no_load_rng):
        checkpoint.no_load_optim = checkpoint.no_load_rng = True
        notes.append(
            "--moe-use-upcycling loads the dense model's weights only (as Megatron-LM, "
            "--no-load-optim --no-load-rng)"
        )
    return notes
