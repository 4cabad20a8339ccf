"""Weak and strong scaling of training tokens/s over 1, 2, 4, 8 ranks, with the efficiency
column, on whatever this machine has: gloo CPU processes here, one process per GPU on a GPU
node (bf16, NCCL).

    python bench/scaling.py > bench/results/scaling.md
    python bench/scaling.py --ranks 1 2 4 8 --parallel tp --plot scaling.png

Each point is one `torchrun --nproc_per_node N pretrain_gpt.py` run of the same model on mock
data; the parallel dimension that grows is DP (default), TP or PP (`--parallel`).
- strong scaling: the global batch is fixed (`--global-batch-size`); N ranks share it.
- weak scaling: every data-parallel replica keeps `--global-batch-size` samples of its own, so
  the global batch grows with DP (with TP or PP the replica is what grows, and the batch is the
  strong one's).
tokens/s is the median of the logged iterations after `--warmup` (each line's global tokens/s);
efficiency = tokens/s(N) / (N x tokens/s(1)). On the CPU every rank runs one thread
(OMP_NUM_THREADS=1): with more ranks than cores the ranks share cores and the efficiency says so
(the table names the core count). The per-run logs are kept (`--log-dir`) and plotted with
tools/plot_logs.py's plotting (`--plot`: tokens/s and loss against iteration, a line per N).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from plot_logs import parse_log, plot  # noqa: E402

MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --position-embedding-type rope --normalization RMSNorm "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 2048 --lr 1e-4 "
    "--eval-iters 0 --eval-interval 1000000 --log-interval 1"
).split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout_flags(parallel: str, ranks: int) -> list[str]:
    if parallel == "tp":
        return ["--tensor-model-parallel-size", str(ranks)]
    if parallel == "pp":
        return ["--pipeline-model-parallel-size", str(ranks)]
    return []


def global_batch(mode: str, parallel: str, ranks: int, batch: int) -> int:
    """Samples per step: fixed (strong), or per data-parallel replica (weak)."""
    return batch * ranks if mode == "weak" and parallel == "dp" else batch


def run(ranks: int, mode: str, args: argparse.Namespace, gpu: bool) -> str:
    """One training run's log (stdout) at `ranks` processes."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(_free_port()),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *MODEL,
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--global-batch-size",
        str(global_batch(mode, args.parallel, ranks, args.global_batch_size)),
        "--train-iters",
        str(args.train_iters),
        *(["--bf16"] if gpu else []),
        *layout_flags(args.parallel, ranks),
        *args.extra.split(),
    ]
    environment = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"scaling.py: {ranks} ranks ({mode}) failed:\n{result.stderr[-3000:]}")
    return result.stdout


def tokens_per_second(log: dict[str, dict[int, float]], warmup: int) -> float:
    """The median logged tokens/s after the warm-up iterations."""
    values = [v for i, v in sorted(log["tokens per second"].items()) if i > warmup]
    if not values:
        raise ValueError(f"no logged iteration after the {warmup} warm-up iterations")
    return statistics.median(values)


def efficiency(rates: dict[int, float]) -> dict[int, float]:
    """tokens/s(N) / (N x tokens/s(1)) for every N measured."""
    base = rates[1]
    return {n: rate / (n * base) for n, rate in rates.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--modes", nargs="+", choices=["strong", "weak"], default=["strong", "weak"]
    )
    parser.add_argument("--parallel", choices=["dp", "tp", "pp"], default="dp")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--train-iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="iterations left out of the median")
    parser.add_argument("--extra", default="", help="more pretrain_gpt.py flags, one string")
    parser.add_argument("--log-dir", default=None, help="keep the runs' logs here")
    parser.add_argument("--plot", default=None, help="PNG: the runs' logs, tools/plot_logs.py")
    args = parser.parse_args(argv)
    if 1 not in args.ranks:
        parser.error("--ranks: include 1, the baseline of the efficiency column")
    if args.warmup >= args.train_iters:
        parser.error("--warmup: leave some of the --train-iters iterations to measure")

    import torch

    gpu = torch.cuda.is_available()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="scaling-")
    os.makedirs(log_dir, exist_ok=True)
    device = (
        f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
        if gpu
        else f"CPU ({platform.machine()}), {os.cpu_count()} cores, one thread per rank"
    )
    print("# Scaling: tokens/s against ranks\n")
    print(f"`python bench/scaling.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    print(f"Device: {device}; torch {torch.__version__}; growing {args.parallel.upper()}.")
    print(
        "Model: LLaMA-style, 4 layers, hidden 256, 8 heads, sequence 256, vocabulary 2048, "
        f"mock data, micro-batch {args.micro_batch_size}; tokens/s is the median of "
        f"iterations {args.warmup + 1}-{args.train_iters} of each run.\n"
    )
    runs = {}
    for mode in args.modes:
        rates = {}
        for ranks in args.ranks:
            output = run(ranks, mode, args, gpu)
            path = os.path.join(log_dir, f"{mode}_{args.parallel}{ranks}.log")
            with open(path, "w") as file:
                file.write(output)
            runs[f"{mode} N={ranks}"] = log = parse_log(path)
            rates[ranks] = tokens_per_second(log, args.warmup)
        print(f"## {mode} scaling\n")
        print("| ranks | global batch | tokens/s | speed-up | efficiency |")
        print("|---:|---:|---:|---:|---:|")
        for ranks, value in efficiency(rates).items():
            batch = global_batch(mode, args.parallel, ranks, args.global_batch_size)
            speedup = rates[ranks] / rates[1]
            print(f"| {ranks} | {batch} | {rates[ranks]:.0f} | {speedup:.2f}x | {value:.0%} |")
        print()
    if args.plot:
        plot(runs, args.plot)
        print(f"Plot: `{args.plot}` (tools/plot_logs.py's panels, a line per run).\n")
    print(f"Logs: `{log_dir}`.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
