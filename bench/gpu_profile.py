"""Where a threefold training step spends its GPU time: the PyTorch profiler over a few steps
of bench/gpu_mfu.py's model, kernels grouped by name, most expensive first; then, on a GPU, the
same ops by their own host time (what the host spends launching them), for a step whose wall
time exceeds its GPU time (the 1B FP8 step: docs/fp8_gpu.md).

    python bench/gpu_profile.py [--steps 2] [-- EXTRA_PRETRAIN_FLAGS...]
    python bench/gpu_profile.py --tiny -- --compile-layers          # the script, on a CPU
    python bench/gpu_profile.py --output-code code.txt -- --compile-layers ...
    python bench/gpu_profile.py --trace trace.json.gz -- ...
    python bench/gpu_profile.py --tree .old/b5ce27a --trace old.json.gz -- ...  # a commit's

--output-code writes the source Inductor generates for the compiled graphs (on a GPU its
Triton kernels, whose names the profile lists) to a file: what a slow fused kernel does.
--trace writes the profiled steps' trace (Chrome format) and prints bench/gpu_timeline.py's
reading of it: GPU time by kind of work, and idle time put down to the host or the device,
with the longest gaps. The trace comes back from a lent GPU to be read again anywhere.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--output-code", metavar="PATH", help="Inductor's generated code, here")
    parser.add_argument("--trace", metavar="PATH", help="the trace (.json or .json.gz), here")
    parser.add_argument(
        "--tree", metavar="DIR", help="profile threefold as it was in DIR (.old/REV, a commit)"
    )
    parser.add_argument("extra", nargs="*", help="pretrain_gpt.py flags added to the bench's")
    args = parser.parse_args()
    if args.output_code:  # read by torch._logging when torch is imported, just below
        os.environ["TORCH_LOGS"] = "output_code"
        os.environ["TORCH_LOGS_OUT"] = os.path.abspath(args.output_code)

    import gpu_timeline  # (this tree's, whichever threefold is profiled)

    if args.tree:  # that tree's threefold and bench/gpu_mfu.py, ahead of this one's
        sys.path[:0] = [os.path.abspath(args.tree), os.path.join(args.tree, "bench")]
    import gpu_mfu
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = gpu_mfu.TINY if args.tiny else gpu_mfu.Shape()
    step = gpu_mfu._threefold(shape, device, cuda, extra=tuple(args.extra))
    for _ in range(args.warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        for _ in range(args.steps):
            step()
    seconds = (time.perf_counter() - start) / args.steps
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    tree = f" (threefold of {args.tree})" if args.tree else ""
    print(f"step {seconds * 1e3:.1f} ms (profiled){tree}, flags: {' '.join(args.extra) or '-'}")
    print(
        profiler.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=90)
    )
    if args.trace:
        profiler.export_chrome_trace(args.trace)
        print(gpu_timeline.report(gpu_timeline.load(args.trace), args.steps))
    if cuda:
        print("by host time (self CPU):")
        print(
            profiler.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=90
            )
        )


if __name__ == "__main__":
    main()
