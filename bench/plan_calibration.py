"""The H100 constants of the step-time model (threefold/training/step_time.py), derived from
the profile of the 1B benchmark step on one H100 (bench/results/gpu_mfu/).

    python bench/plan_calibration.py

- GEMM efficiency: the step's matrix-multiplication FLOPs (forward + backward, output layer
  included) over the GPU time of `aten::mm` in profile.txt, as a fraction of the bf16 peak;
- attention efficiency: Megatron's count of one layer's attention FLOPs (forward + backward)
  over the fastest fused kernel's forward+backward time the `> kernels:` line reports;
- memory-bound bytes: the GPU time left (profile total - GEMMs - attention - the optimizer's
  HBM traffic) at the HBM bandwidth, per token, hidden element and layer.
Then the 1B step is predicted from those constants and set against the measured tokens/s of
gpu_mfu.md: the difference is what the model leaves out (the GPU idle between kernels).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from threefold.arguments import parse_args  # noqa: E402
from threefold.training.flops import training_flops_per_iteration  # noqa: E402
from threefold.training.step_time import H100, predict_step_time, tokens_per_second  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "gpu_mfu")
LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --group-query-attention --bf16 --mock-data "
    "--tokenizer-type NullTokenizer --attention-dropout 0 --hidden-dropout 0"
).split()


def benchmark() -> tuple[dict, float]:
    """The 1B shape of gpu_mfu.md and threefold's measured tokens/s there."""
    with open(os.path.join(RESULTS, "gpu_mfu.md")) as file:
        text = file.read()
    shape = ast.literal_eval(re.search(r"Shape: (\{.*?\})", text).group(1))
    (measured,) = re.findall(r"^\| threefold \| ([\d,]+) \|", text, re.MULTILINE)
    return shape, float(measured.replace(",", ""))


def benchmark_flags(shape: dict) -> list[str]:
    flags = [*LLAMA, "--max-position-embeddings", str(shape["seq_length"])]
    for key, value in shape.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def profile_times() -> dict[str, float]:
    """Seconds: the profiled step's GPU total and aten::mm; one attention forward+backward."""
    with open(os.path.join(RESULTS, "profile.txt")) as file:
        text = file.read()
    total = float(re.search(r"Self CUDA time total: ([\d.]+)ms", text).group(1)) / 1e3
    mm = re.search(r"^\s+aten::mm\s.*$", text, re.MULTILINE).group(0).split()
    attention = re.search(r"CUDNN_ATTENTION ([\d.]+) ms", text).group(1)
    return {
        "total": total,
        "mm": float(mm[6].rstrip("ms")) / 1e3,
        "attention": float(attention) / 1e3,
    }


def calibrate() -> tuple[dict, dict]:
    """The constants, and the 1B prediction against the measurement."""
    shape, measured = benchmark()
    config = parse_args(benchmark_flags(shape), world_size=1, prog="plan_calibration.py")
    model, training = config.model, config.training
    times = profile_times()
    s, h, b = model.seq_length, model.hidden_size, training.micro_batch_size
    vocab = model.padded_vocab_size(1)
    tokens = training.global_batch_size * s
    layers = model.num_layers
    peak = H100.peak_tflops * 1e12
    total = training_flops_per_iteration(model, training.global_batch_size, vocab)
    attention_per_token = 4 * s * model.kv_channels * model.num_attention_heads
    attention = 3 * attention_per_token * tokens * layers
    gemm_efficiency = (total - attention) / times["mm"] / peak
    attention_efficiency = 3 * attention_per_token * b * s / times["attention"] / peak
    attention_time = times["attention"] * layers * training.global_batch_size / b
    optimizer = predict_step_time(config, H100, 8).optimizer
    left = times["total"] - times["mm"] - attention_time - optimizer
    memory_bytes = left * H100.hbm_gbps * 1e9 / (tokens * h * layers)
    constants = {
        "gemm_efficiency": round(gemm_efficiency, 3),
        "attention_efficiency": round(attention_efficiency, 3),
        "memory_bytes_per_element": round(memory_bytes, -1),
        "calibration_dim": h,
    }
    calibrated = dataclasses.replace(H100, **constants)
    predicted = tokens_per_second(config, predict_step_time(config, calibrated, 8))
    return constants, {"measured": measured, "predicted": predicted}


def main() -> int:
    constants, check = calibrate()
    print("H100 constants (threefold/training/step_time.py's H100):")
    for name, value in constants.items():
        print(f"  {name} = {value}   (in the code: {getattr(H100, name)})")
    error = check["predicted"] / check["measured"] - 1
    print(
        f"1B benchmark on one H100: predicted {check['predicted']:,.0f} tokens/s, measured "
        f"{check['measured']:,.0f} ({error:+.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
