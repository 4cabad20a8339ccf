"""What the Mamba-2 scan's grouped B and C save (threefold/kernels/ssd.py).

A group's heads share its B and C (--mamba-num-groups): the chunked scan reads them a group at
a time, so C B^T is made once a group and broadcast over the group's heads' decays. This
times that against the same scan given B and C copied to every head (groups = heads: what the
scan did before), forward and backward, and reads each one's peak resident memory (glibc's
mapping threshold fixed, so freed tensors leave; the peak restarted before each):

    python bench/ssd_scan.py [--seq-length 2048] [--heads 32] [--groups 4] [--repeats 3]

and prints a markdown table: milliseconds per forward+backward, peak memory over the start,
and the largest difference of the two outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.chunked_attention import _mib  # noqa: E402
from threefold.kernels.ssd import chunk_ssd  # noqa: E402


def _run(inputs: list[torch.Tensor], per_head: bool) -> tuple[torch.Tensor, float, float]:
    """(the output, seconds, peak MiB over the start) of one forward and backward."""
    x, dt, A, B, C, D = (t.detach().requires_grad_() for t in inputs)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _mib("VmRSS")
    start = time.perf_counter()
    if per_head:  # (B and C copied to each head, inside the timed region as the scan did)
        copies = x.shape[2] // B.shape[2]
        B, C = (t.repeat_interleave(copies, dim=2) for t in (B, C))
    output = chunk_ssd(x, dt, A, B, C, D)
    output.sum().backward()
    return output.detach(), time.perf_counter() - start, _mib("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--state-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: freed tensors unmapped
    torch.manual_seed(0)
    s, h, g = args.seq_length, args.heads, args.groups
    inputs = [
        torch.randn(1, s, h, args.head_dim),
        F.softplus(torch.randn(1, s, h)),
        -torch.rand(h) * 15 - 1,
        torch.randn(1, s, g, args.state_dim),
        torch.randn(1, s, g, args.state_dim),
        torch.ones(h),
    ]
    rows, outputs = [], {}
    for name, per_head in (("B, C a group", False), ("B, C copied to each head", True)):
        _run(inputs, per_head)  # (warm-up)
        runs = [_run(inputs, per_head) for _ in range(args.repeats)]
        outputs[name] = runs[0][0]
        rows.append((name, min(run[1] for run in runs), max(run[2] for run in runs)))
    difference = (outputs[rows[0][0]] - outputs[rows[1][0]]).abs().max().item()
    print(
        f"sequence {s}, {h} heads of {args.head_dim} in {g} groups of state {args.state_dim}, "
        f"fp32, {torch.get_num_threads()} CPU threads, torch {torch.__version__}"
    )
    print("\n| B and C | ms per forward+backward | peak MiB over the start |")
    print("|---|---:|---:|")
    for name, seconds, peak in rows:
        print(f"| {name} | {seconds * 1e3:.0f} | {peak:.0f} |")
    print(f"\nlargest difference of the outputs: {difference:.1e}")
    print(f"grouped / copied time: {rows[0][1] / rows[1][1]:.2f}")


if __name__ == "__main__":
    main()
