"""What a compiled FP8 layer keeps for backward, with its casts as opaque operators
(kernels/fp8_ops.py, what a CUDA run with Triton uses) and with the reference casts that
Inductor fuses (`+fused-casts` in bench/gpu_mfu.py): the tensors autograd saves over one
forward of one transformer layer of gpu_mfu.py's shape in a training step, with the weights'
FP8 copies the step holds, by kind, and the difference.

    python bench/fp8_saved_tensors.py [--tiny] [--out bench/results/fp8_saved_tensors.md]

The byte counts depend on the shape and not on the device, so a CPU gives the numbers an H100
holds per layer (one micro-batch in flight: no pipeline parallelism).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

from gpu_mfu import FP8_FLAGS, TINY, Shape, threefold_args  # noqa: E402

MODES = {"opaque": True, "fused": False}  # KERNELS.opaque_fp8_casts


def saved_tensors(shape: Shape, opaque: bool) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, dtype, bytes) of each storage one layer's forward in a training step saves for
    backward, and of the weights' FP8 copies the step holds (the weights themselves excluded),
    the layer compiled as --compile-layers compiles it."""
    import torch

    from threefold.arguments import parse_args
    from threefold.kernels.dispatch import KERNELS
    from threefold.parallel.parallel_context import ParallelContext
    from threefold.training.trainer import Trainer

    argv = threefold_args(dataclasses.replace(shape, num_layers=1), bf16=True)
    config = parse_args(argv + list(FP8_FLAGS) + ["--compile-layers"], world_size=1)
    trainer = Trainer(config, torch.device("cpu"), ParallelContext())
    KERNELS.opaque_fp8_casts = opaque
    torch._dynamo.reset()
    layer = trainer.model_chunks[0].decoder.layers[0]
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, tuple[tuple[int, ...], str, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            dtype = str(tensor.dtype).removeprefix("torch.")
            saved[storage.data_ptr()] = (tuple(tensor.shape), dtype, storage.nbytes())
        return tensor

    tokens = shape.seq_length, shape.micro_batch_size, shape.hidden_size
    hidden = torch.randn(tokens, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the first call compiles (and casts the weights' first scales)
        saved.clear()
        # as in a training step: the weights' FP8 copies are cast for the step and held by it
        with trainer.fp8.weights_cached():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                layer(hidden, None)
            for state in trainer.fp8.states.values():
                for copy in state.weight_cache[1:]:
                    if isinstance(copy, torch.Tensor) and copy.dtype.itemsize == 1:
                        pack(copy)
    return list(saved.values())


def report(shape: Shape, results: dict[str, list]) -> str:
    lines = [
        "# What a compiled FP8 layer saves for backward: opaque casts vs fused",
        "",
        f"One transformer layer of bench/gpu_mfu.py's shape ({shape.seq_length} x "
        f"{shape.micro_batch_size} tokens, hidden {shape.hidden_size}, FFN "
        f"{shape.ffn_hidden_size}), bf16, delayed FP8 (hybrid), --compile-layers; one forward "
        "in a training step: the tensors autograd saves and the weights' FP8 copies the step "
        "holds (the weights excluded), by dtype:",
        "",
        "| casts | "
        + " | ".join(f"{d} MiB" for d in ("bfloat16", "float32", "float8"))
        + " | total MiB |",
        "|---|---|---|---|---|",
    ]
    totals, fp8 = {}, {}
    for mode, saved in results.items():
        by_dtype = collections.Counter()
        for _, dtype, nbytes in saved:
            by_dtype["float8" if dtype.startswith("float8") else dtype] += nbytes
        totals[mode], fp8[mode] = sum(by_dtype.values()), by_dtype["float8"]
        cells = [f"{by_dtype[d] / 2**20:,.1f}" for d in ("bfloat16", "float32", "float8")]
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {totals[mode] / 2**20:,.1f} |")
    extra = totals["opaque"] - totals["fused"]
    lines += [
        "",
        f"The opaque casts keep {extra / 2**20:,.1f} MiB more per layer and micro-batch in flight "
        f"({extra * shape.num_layers / 2**30:.2f} GiB over {shape.num_layers} layers): "
        f"{totals['opaque']:,} bytes against {totals['fused']:,}, of which FP8 "
        f"{fp8['opaque']:,} and {fp8['fused']:,}. The FP8 tensors, by shape:",
        "",
    ]
    lines += [
        f"- {list(size)} {dtype}: {nbytes / 2**20:,.1f} MiB"
        for size, dtype, nbytes in sorted(results["opaque"], key=lambda t: -t[2])
        if dtype.startswith("float8")
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="gpu_mfu.py's tiny check shape")
    parser.add_argument("--out", help="write the report here (default: print it)")
    args = parser.parse_args()
    shape = TINY if args.tiny else Shape()
    results = {mode: saved_tensors(shape, opaque) for mode, opaque in MODES.items()}
    text = report(shape, results)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
