"""Run pretrain_gpt.py's trainer on a Ray cluster through Ray Train's `TorchTrainer`.

    python launch/ray_gpt.py --num-workers 16 --use-gpu --storage-path /shared/ray \\
        -- --tensor-model-parallel-size 8 ... --save /shared/checkpoints/gpt

Everything after `--` is pretrain_gpt.py's command line, unchanged. Ray places the workers
(one per GPU, or `--cpus-per-worker` CPUs each without `--use-gpu`), sets torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR) and builds the default process group;
megatron-core's TP/PP/DP groups are then built over that group exactly as under torchrun.

A failed worker (a killed process, a lost node) makes Ray restart the whole worker group, up to
`--max-failures` times; the restarted trainer resumes from the newest complete checkpoint in
`--save` (the launcher adds `--load` = `--save` when no `--load` is given), so `--save` must be
on storage every node sees. `--storage-path` is Ray's own run directory (its logs and state).
Without `--address` (or RAY_ADDRESS) a single-machine Ray cluster is started for the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain_gpt.py")


def parse_launcher_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's flags (before `--`) and pretrain_gpt.py's (after it)."""
    if "--" not in argv:
        own, trainer = argv, []
    else:
        split = argv.index("--")
        own, trainer = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="ray_gpt.py",
        description="pretrain_gpt.py on a Ray cluster",
        usage="ray_gpt.py [flags] -- [pretrain_gpt.py flags]",
    )
    parser.add_argument("--num-workers", type=int, required=True, help="training processes")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, nccl")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else local)"
    )
    parser.add_argument("--storage-path", default=None, help="Ray's run directory (RunConfig)")
    parser.add_argument("--name", default="threefold-gpt", help="the Ray Train run's name")
    parser.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="worker-group restarts before the run fails (Ray's FailureConfig)",
    )
    args = parser.parse_args(own)
    if args.num_workers < 1:
        parser.error(f"--num-workers {args.num_workers}: give at least one worker")
    if not trainer:
        parser.error("no pretrain_gpt.py flags: put them after `--`")
    return args, trainer


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def trainer_argv(argv: list[str], max_failures: int) -> list[str]:
    """pretrain_gpt.py's flags as each worker runs them: --load defaults to --save, so that a
    restarted worker group resumes instead of starting over."""
    save = _flag_value(argv, "--save")
    if save and _flag_value(argv, "--load") is None:
        print(f"> ray_gpt.py: --load {save} (--save): a restarted worker group resumes there")
        return [*argv, "--load", save]
    if not save and max_failures > 0:
        print("> ray_gpt.py: no --save: a restarted worker group starts from iteration 0")
    return argv


# Ray starts workers from its own daemons, not from this process: the settings that shape a
# run (NCCL, cuBLAS, CUDA connections, threads) are handed to them explicitly.
FORWARDED = ("NCCL_", "TORCH_", "CUDA_DEVICE_MAX_CONNECTIONS", "CUBLAS_", "OMP_NUM_THREADS")


def forwarded_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED)}


def train_worker(config: dict) -> None:
    """One Ray Train worker: pretrain_gpt.py's main() in this process, over Ray's group."""
    import importlib.util

    sys.path.insert(0, config["root"])  # threefold itself, where it is not pip-installed
    spec = importlib.util.spec_from_file_location("pretrain_gpt", config["script"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(config["argv"])
    if code:
        raise RuntimeError(f"pretrain_gpt.py exited with code {code} (its error is above)")


def main(argv: list[str] | None = None) -> int:
    args, trainer = parse_launcher_args(sys.argv[1:] if argv is None else argv)
    if "--exit-signal-handler" in trainer:
        print(
            "ray_gpt.py: error: --exit-signal-handler: Ray Train runs the trainer in a worker "
            "thread, where signal handlers cannot be installed, and stops workers itself; "
            "leave the flag out (save with --save-interval, and --exit-duration-in-mins works)",
            file=sys.stderr,
        )
        return 2
    # Flags and input files checked once, here, before Ray starts anything: one line, exit 2.
    check = subprocess.run(
        [sys.executable, SCRIPT, *trainer],
        env=dict(os.environ, WORLD_SIZE=str(args.num_workers), THREEFOLD_VALIDATE_ONLY="1"),
    )
    if check.returncode:
        return check.returncode
    trainer = trainer_argv(trainer, args.max_failures)

    # Each worker's lines reach this terminal as printed: Ray would fold identical lines of
    # different workers into one "[repeated 2x]" summary.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address, runtime_env={"env_vars": forwarded_environment()})
    resources = {"CPU": args.cpus_per_worker, **({"GPU": 1} if args.use_gpu else {})}
    run = TorchTrainer(
        train_worker,
        train_loop_config={"root": ROOT, "script": SCRIPT, "argv": trainer},
        scaling_config=ScalingConfig(
            num_workers=args.num_workers, use_gpu=args.use_gpu, resources_per_worker=resources
        ),
        # Ray builds the default group: it gets the trainer's own timeout, as under torchrun.
        torch_config=TorchConfig(
            backend="nccl" if args.use_gpu else "gloo",
            timeout_s=int(60 * float(_flag_value(trainer, "--distributed-timeout-minutes") or 10)),
        ),
        run_config=RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    try:
        run.fit()
    except Exception as error:  # Ray's TrainingFailedError, with every worker's traceback
        print(f"ray_gpt.py: error: the run failed: {type(error).__name__}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
