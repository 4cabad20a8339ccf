"""FP8 against bf16 (fp32 on a CPU) over a few hundred steps on the default corpus: the
validation losses side by side and the curves plotted (tools/plot_logs.py).

    python bench/fp8_loss.py --out bench/results/fp8_loss                # 300 steps
    python bench/fp8_loss.py --iters 20 --out /tmp/fp8_loss_smoke        # the script itself
    python bench/fp8_loss.py --only fp8_tensorwise    # rerun one; the report reads the others
    python bench/fp8_loss.py --moe --out bench/results/fp8_loss_moe    # the MoE model
    python bench/fp8_loss.py --only base --no-report & ...; wait; python bench/fp8_loss.py --only
                                                       # runs side by side, then the report

Seven runs of the same model, data and seed, one process each: the base precision (--bf16 on
a GPU, fp32 on a CPU); the same with FP8 GEMMs under delayed scaling (Megatron-LM's Llama-3
recipe: hybrid, amax history 1024, max), and with --fp8-margin 1 on top; with FP8
tensorwise scaling; with rowwise scaling (torchao's recipe, and with E5M2 gradients); and with
blockwise scaling (Megatron-LM's, E4M3). On a CPU the FP8 GEMMs are torch._scaled_mm's exact
emulation (blockwise: the blocks dequantized exactly, then an fp32 GEMM), so the numerics are
the GPU's (the accumulation order aside) and only the speed is not.

--moe: the same model with a mixture of experts in every layer (4 experts of FFN 512, top-2,
load-balancing loss), in three runs: the base precision; tensorwise FP8, which leaves the
experts in the base precision; and rowwise FP8, whose experts run in FP8 too (docs/fp8.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "shakespeare_text_document")
TOKENIZER = os.path.join(ROOT, "data", "shakespeare_sp.model")
RUNS = {
    "base": [],
    "fp8_delayed": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]
    + ["--fp8-amax-compute-algo", "max"],
    "fp8_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    # delayed scales from earlier steps clamp tensors whose amax is still growing (activations
    # early in training); a margin of one halves every scale, leaving a factor of 2 of headroom
    "fp8_delayed_margin1": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]
    + ["--fp8-amax-compute-algo", "max", "--fp8-margin", "1"],
    # torchao's rowwise recipe (E4M3 throughout): a scale per row of each GEMM operand; and
    # with E5M2 gradients, as the other FP8 runs here
    "fp8_rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
    "fp8_rowwise_hybrid": ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
    # Megatron-LM's blockwise (TE's Float8BlockScaling, DeepSeek-V3's): a scale per 1 x 128
    # block of activations and gradients, per 128 x 128 of weights, E4M3 throughout as usual
    "fp8_blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
MOE = "--num-experts 4 --moe-ffn-hidden-size 512 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2"
MOE_RUNS = {name: RUNS[name] for name in ("base", "fp8_tensorwise", "fp8_rowwise")}
VALIDATION = re.compile(
    r"validation loss at iteration (\d+) on validation set \| lm loss value: (\S+)"
)


def model_flags(iters: int, moe: bool = False) -> list[str]:
    """launch/demo.sh's model and data, in one process (`moe`: its MLPs mixtures of experts)."""
    return (
        (
            "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
            "--num-query-groups 4 --seq-length 256 --max-position-embeddings 256 "
            "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
            "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 "
            "--micro-batch-size 8 --global-batch-size 16 --lr 2e-3 --min-lr 2e-4 "
            "--lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 "
            f"--split 969,30,1 --log-interval 10 --eval-interval 50 --eval-iters 8 "
            f"--tokenizer-type SentencePieceTokenizer --train-iters {iters} --seed 1234"
        ).split()
        + ["--data-path", DATA, "--tokenizer-model", TOKENIZER]
        + precision()
        + (MOE.split() if moe else [])
    )


def precision() -> list[str]:
    """bf16 on a GPU; fp32 on a CPU, whose bf16 GEMMs are many times slower than its fp32
    ones (the FP8 runs then compute everything but their GEMMs in fp32)."""
    import torch

    return ["--bf16"] if torch.cuda.is_available() else []


def base_precision(log: str) -> str:
    """The base run's precision, from the device its log names (`precision`'s choice there):
    the report may be written on another machine than the runs."""
    with open(log) as stream:
        device = re.search(r"> world size .* on (\w+);", stream.read())
    if device is None:
        sys.exit(f"{log} names no device: not a pretrain_gpt.py log")
    return "bf16 (`--bf16`, on a GPU)" if device.group(1) == "cuda" else "fp32 (on a CPU)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fp8_loss"))
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument(
        "--only", nargs="*", choices=RUNS, help="run these; the others' logs are read from --out"
    )
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts model")
    parser.add_argument(
        "--no-report", action="store_true", help="only the runs (side by side with other --only)"
    )
    args = parser.parse_args()
    runs = MOE_RUNS if args.moe else RUNS
    if not os.path.exists(DATA + ".bin"):
        sys.exit(f"{DATA}.bin is missing: run `make data` first")
    os.makedirs(args.out, exist_ok=True)
    final = {}
    for name, flags in runs.items():
        log = os.path.join(args.out, f"{name}.log")
        flags_of_model = model_flags(args.iters, args.moe)
        command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags_of_model]
        if args.only is None or name in args.only:
            with open(log, "w") as stream:
                subprocess.run(command + flags, stdout=stream, stderr=subprocess.STDOUT, check=True)
        if args.no_report or not os.path.exists(log):  # (the report names those not run)
            continue
        with open(log) as stream:
            final[name] = float(VALIDATION.findall(stream.read())[-1][1])
    if args.no_report:
        return
    if "base" not in final:
        sys.exit(f"{args.out}/base.log is missing: run the base precision first")
    logs = [os.path.join(args.out, f"{name}.log") for name in final]
    plot = os.path.join(args.out, "fp8_loss.png")
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plot_logs.py"), *logs, "--labels", *final]
        + ["--output", plot],
        check=True,
    )
    rows = [
        f"| {name} | {loss:.4f} | {100 * (loss - final['base']) / final['base']:+.2f}% |"
        for name, loss in final.items()
    ]
    report = "\n".join(
        [
            f"# FP8 against the base precision, {args.iters} steps on the default corpus",
            "",
            f"`python bench/fp8_loss.py --iters {args.iters}{' --moe' if args.moe else ''}`; "
            "launch/demo.sh's LLaMA-style model (4 layers, hidden 256, GQA 8/4 heads, SwiGLU, "
            "sequence 256, 16 sequences per step) in one process"
            + (f", every MLP a mixture of experts (`{MOE}`)" if args.moe else "")
            + "; the FP8 runs' flags:",
            "",
            *[f"- {name}: `{' '.join(runs[name])}`" for name in final if runs[name]],
            "",
            "Raw logs and fp8_loss.png beside this file. On a CPU the FP8 GEMMs are an "
            "emulation and the runs may share the cores: the tokens-per-second panel is no "
            "speed measure there.",
            "",
            f"Base precision: {base_precision(logs[0])}.",
            "",
            "| run | final validation loss | against the base |",
            "|---|---|---|",
            *rows,
            "",
            *(
                [f"Not run here: {', '.join(sorted(set(runs) - set(final)))}.", ""]
                if set(runs) - set(final)
                else []
            ),
        ]
    )
    with open(os.path.join(args.out, "fp8_loss.md"), "w") as stream:
        stream.write(report)
    print(report)


if __name__ == "__main__":
    main()
