"""What --attention-chunk-size's two paths cost (threefold/model/attention.py).

transformers' Llama 4 has its layers with RoPE attend within chunks of 8192 tokens. Over a
sequence of whole chunks threefold folds the chunks into the batch and runs each as causal
attention of its own (`_in_chunks`); packed documents, or a last chunk cut short, take the
[s, s] chunk mask instead. This times both on the same layer, forward and backward, and
reads each one's peak resident memory (glibc's mapping threshold fixed, so freed tensors
leave; the peak restarted before each):

    python bench/chunked_attention.py [--seq-length 8192] [--chunk 2048] [--repeats 3]

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.config import ModelConfig  # noqa: E402
from threefold.model.attention import SelfAttention  # noqa: E402
from threefold.parallel.state import parallel_context  # noqa: E402
from threefold.parallel.tensor_parallel.sharding import normal_init  # noqa: E402


def _mib(key: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _run(attention, query, key, value, mask) -> tuple[torch.Tensor, float, float]:
    """(the output, seconds, peak MiB over the start) of one forward and backward."""
    query, key, value = (x.detach().requires_grad_() for x in (query, key, value))
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _mib("VmRSS")
    start = time.perf_counter()
    output = attention._core_attention(query, key, value, mask)
    output.sum().backward()
    return output.detach(), time.perf_counter() - start, _mib("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: freed tensors unmapped
    torch.manual_seed(0)
    config = ModelConfig(
        num_layers=1,
        hidden_size=args.heads * args.head_dim,
        num_attention_heads=args.heads,
        seq_length=args.seq_length,
        position_embedding_type="rope",
        attention_chunk_size=args.chunk,
        attention_dropout=0.0,
        vocab_size=128,
    )
    config.finalize()
    attention = SelfAttention(config, parallel_context(), normal_init(0.02), normal_init(0.02))
    shape = (args.seq_length, 1, args.heads, args.head_dim)
    query, key, value = (torch.randn(shape) for _ in range(3))
    one_document = torch.ones(1, 1, args.seq_length, args.seq_length, dtype=torch.bool)
    rows, outputs = [], {}
    for name, mask in (("folded into the batch", None), ("[s, s] chunk mask", one_document)):
        _run(attention, query, key, value, mask)  # (warm-up)
        runs = [_run(attention, query, key, value, mask) for _ in range(args.repeats)]
        outputs[name] = runs[0][0]
        seconds = min(run[1] for run in runs)
        peak = max(run[2] for run in runs)
        rows.append((name, seconds, peak))
    difference = (outputs[rows[0][0]] - outputs[rows[1][0]]).abs().max().item()
    print(
        f"sequence {args.seq_length}, chunk {args.chunk}, {args.heads} heads of "
        f"{args.head_dim}, fp32, {torch.get_num_threads()} CPU threads, torch {torch.__version__}"
    )
    print("\n| path | ms per forward+backward | peak MiB over the start |")
    print("|---|---:|---:|")
    for name, seconds, peak in rows:
        print(f"| {name} | {seconds * 1e3:.0f} | {peak:.0f} |")
    print(f"\nlargest difference of the outputs: {difference:.1e}")
    print(f"folded / mask time: {rows[0][1] / rows[1][1]:.2f}")


if __name__ == "__main__":
    main()
