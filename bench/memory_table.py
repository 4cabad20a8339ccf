"""Per-GPU memory of LLaMA-2 7B/13B/70B in the layouts Megatron-Core's guides use, from
threefold's estimator (tools/estimate_memory.py), against 80 GB GPUs; then the same models
in bf16 beside FP8 GEMMs with and without --fp8-param-gather, and with rowwise scaling (with
Mixtral 8x7B, whose experts rowwise scaling alone puts in FP8), and with the precision-aware
optimizer's state in fewer bits.

    python bench/memory_table.py > bench/results/memory_table.md

and last a DeepSeek-V3-shaped MoE by --recompute-modules.

No GPU is needed: the estimate is computed, not measured. What it counts is held within 1%
of CPU measurements by tests/training/test_memory_estimate.py.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import parse_args  # noqa: E402
from threefold.training.memory_estimate import estimate_memory  # noqa: E402

GIB = 2**30
LLAMA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--vocab-size",
    "32000",
    "--seq-length",
    "4096",
    "--bf16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1024",
    "--mock-data",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
MODELS = {
    "LLaMA-2 7B": [
        "--num-layers",
        "32",
        "--hidden-size",
        "4096",
        "--num-attention-heads",
        "32",
        "--ffn-hidden-size",
        "11008",
    ],
    "LLaMA-2 13B": [
        "--num-layers",
        "40",
        "--hidden-size",
        "5120",
        "--num-attention-heads",
        "40",
        "--ffn-hidden-size",
        "13824",
    ],
    "LLaMA-2 70B": [
        "--num-layers",
        "80",
        "--hidden-size",
        "8192",
        "--num-attention-heads",
        "64",
        "--group-query-attention",
        "--num-query-groups",
        "8",
        "--ffn-hidden-size",
        "28672",
    ],
}
# (GPUs, TP, PP): the layouts Megatron-Core's training guides give for these sizes.
RECOMMENDED = {"LLaMA-2 7B": (8, 1, 1), "LLaMA-2 13B": (8, 2, 1), "LLaMA-2 70B": (64, 4, 4)}
# Mixtral 8x7B in Megatron-LM's example layout (examples/mixtral: TP2 PP4 EP8, 64 GPUs), for the
# FP8 table: rowwise scaling puts its experts in FP8 too.
MIXTRAL = MODELS["LLaMA-2 7B"][:-1] + ["14336", "--group-query-attention"]
MIXTRAL += ["--num-query-groups", "8", "--num-experts", "8", "--moe-router-topk", "2"]
MIXTRAL += ["--moe-ffn-hidden-size", "14336", "--expert-model-parallel-size", "8"]
MIXTRAL += ["--sequence-parallel"]
MODELS["Mixtral 8x7B"] = MIXTRAL
FP8_ONLY = {"Mixtral 8x7B"}  # in the FP8 table only
RECOMMENDED["Mixtral 8x7B"] = (64, 2, 4)
VARIANTS = {
    "replicated optimizer, selective recompute": ["--recompute-granularity", "selective"],
    "distributed optimizer, selective recompute": [
        "--use-distributed-optimizer",
        "--recompute-granularity",
        "selective",
    ],
    "distributed optimizer, SP, full recompute": [
        "--use-distributed-optimizer",
        "--sequence-parallel",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ],
}


# FP8 (docs/fp8.md) on the distributed-optimizer, selective-recompute rows: the linears' 1-byte
# input copies, the step's FP8 weight copies, and --fp8-param-gather's FP8-only weights.
FP8_BASE = "distributed optimizer, selective recompute"
FP8_VARIANTS = {
    "bf16": [],
    "FP8 hybrid": ["--fp8-format", "hybrid"],
    "FP8 hybrid, --fp8-param-gather": ["--fp8-format", "hybrid", "--fp8-param-gather"],
    "FP8 rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
}


# --use-precision-aware-optimizer (docs/parallelism.md) on the same rows: a bf16 run's masters
# as 16-bit remainders, then the moments and gradients in bf16.
OPTIMIZER_VARIANTS = {
    "AdamW, fp32 state": [],
    "precision-aware (remainders)": ["--use-precision-aware-optimizer"],
    "precision-aware, bf16 moments": ["--use-precision-aware-optimizer"]
    + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    "precision-aware, bf16 moments and gradients": ["--use-precision-aware-optimizer"]
    + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--main-grads-dtype", "bf16"],
}

SIZES = ("params", "grads", "optimizer", "activations")


def _header(*columns: str) -> None:
    columns = ("model", "GPUs", "TP", "PP", "DP", *columns)
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def _config(model: str, variant: list[str]):
    gpus, tp, pp = RECOMMENDED[model]
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    return parse_args(LLAMA + MODELS[model] + variant + layout, world_size=gpus)


def fp8_table() -> None:
    _header("precision", *SIZES[:4], "fp8 weights", "total GiB")
    for model in MODELS:
        gpus, tp, pp = RECOMMENDED[model]
        for name, variant in FP8_VARIANTS.items():
            config = _config(model, VARIANTS[FP8_BASE] + variant)
            e = estimate_memory(config)
            sizes = (e.parameters, e.gradients, e.optimizer, e.activations, e.fp8_weights, e.total)
            dp = config.parallel.data_parallel_size
            row = [model, gpus, tp, pp, dp, name, *(f"{x / GIB:.1f}" for x in sizes)]
            print("| " + " | ".join(str(x) for x in row) + " |")


def optimizer_table() -> None:
    _header("optimizer", *SIZES[:4], "total GiB")
    for model in [model for model in MODELS if model not in FP8_ONLY]:
        gpus, tp, pp = RECOMMENDED[model]
        for name, variant in OPTIMIZER_VARIANTS.items():
            config = _config(model, VARIANTS[FP8_BASE] + variant)
            e = estimate_memory(config)
            sizes = (e.parameters, e.gradients, e.optimizer, e.activations, e.total)
            dp = config.parallel.data_parallel_size
            row = [model, gpus, tp, pp, dp, name, *(f"{x / GIB:.1f}" for x in sizes)]
            print("| " + " | ".join(str(x) for x in row) + " |")


# Megatron-LM's DeepSeek-V3 proxy (tests/functional_tests/.../deepseekv3_proxy_flex_tp1pp4emp16
# etp1cp1_release: DeepSeek-V3's width, MLA and routing, 14 of its 61 layers, 64 experts) in
# its layout, TP2 x PP4 x EP16 over 128 GPUs, for --recompute-modules.
DEEPSEEK_PROXY = [
    *(
        "--num-layers 14 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
        "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 "
        "--mscale 1.0 --mscale-all-dim 1.0 --num-experts 64 --moe-layer-freq ([0]*3+[1]*11) "
        "--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 "
        "--moe-router-topk 8 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-num-groups 8 --moe-router-group-topk 4 --moe-grouped-gemm "
        "--moe-token-dispatcher-type alltoall --mtp-num-layers 1 --vocab-size 129280 "
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4 "
        "--pipeline-model-parallel-layout Et*2|(tt|)*5t|tmL --expert-model-parallel-size 16 "
        "--expert-tensor-parallel-size 1 --use-distributed-optimizer"
    ).split(),
    *LLAMA[:7],  # (its vocabulary is DeepSeek-V3's)
    *LLAMA[9:],
]
RECOMPUTE_MODULES = {
    "none": [],
    "core_attn (selective's default)": ["--recompute-granularity", "selective"],
    "layernorm mla_up_proj moe_act": ["layernorm", "mla_up_proj", "moe_act"],
    "layernorm mla_up_proj moe_act core_attn": ["layernorm", "mla_up_proj", "moe_act", "core_attn"],
    "mlp moe mla_up_proj layernorm (Megatron-FSDP's DeepSeek-V3 example)": [
        "mlp",
        "moe",
        "mla_up_proj",
        "layernorm",
    ],
    "full, uniform, 1 layer": ["--recompute-granularity", "full", "--recompute-method"]
    + ["uniform", "--recompute-num-layers", "1"],
}


def recompute_table() -> None:
    print("| recomputation | activations GiB (stage) | total GiB |")
    print("|---|---|---|")
    for name, flags in RECOMPUTE_MODULES.items():
        if flags and not flags[0].startswith("--"):
            flags = ["--recompute-granularity", "selective", "--recompute-modules", *flags]
        e = estimate_memory(parse_args(DEEPSEEK_PROXY + flags, world_size=128))
        print(f"| {name} | {e.activations / GIB:.1f} ({e.stage}) | {e.total / GIB:.1f} |")


def main() -> None:
    _header("options", *SIZES[:4], "total GiB", "fits 90% of 80 GB")
    for model in [model for model in MODELS if model not in FP8_ONLY]:
        gpus, tp, pp = RECOMMENDED[model]
        for name, variant in VARIANTS.items():
            if "SP" in name and tp == 1:
                continue
            config = _config(model, variant)
            e = estimate_memory(config)
            row = [
                model,
                gpus,
                tp,
                pp,
                config.parallel.data_parallel_size,
                name,
                *(
                    f"{x / GIB:.1f}"
                    for x in (e.parameters, e.gradients, e.optimizer, e.activations, e.total)
                ),
                "yes" if e.total <= 80e9 * 0.9 else "no",
            ]
            print("| " + " | ".join(str(x) for x in row) + " |")
    print(f"\nWith FP8 GEMMs ({FP8_BASE}):\n")
    fp8_table()
    print(f"\nWith the precision-aware optimizer ({FP8_BASE}):\n")
    optimizer_table()
    print(
        "\nMegatron-LM's DeepSeek-V3 proxy (14 layers at DeepSeek-V3's width, MLA, 64 experts, "
        "MTP; bf16, sequence 4096, micro-batch 1; TP2 x SP x PP4 x EP16, 128 GPUs, distributed "
        "optimizer), the pipeline stage that needs most, by --recompute-modules:\n"
    )
    recompute_table()


if __name__ == "__main__":
    main()
