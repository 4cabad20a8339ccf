"""Megatron-LM's `--use-megatron-fsdp` and its flags, run on threefold's FSDP2.

Megatron-FSDP is megatron-core's own ZeRO-3; threefold shards with PyTorch's FSDP2
(`--distributed-strategy fsdp`, docs/parallelism.md), which computes the same step: each
rank holds a shard of every parameter, its gradients and its optimizer state, parameters are
all-gathered for the forward and backward, gradients reduce-scattered. So a Megatron-FSDP
script runs here as FSDP2, and what does not carry over is refused in one line:

- `--data-parallel-sharding-strategy optim_grads_params` (Megatron-FSDP's default) is FSDP2.
  `optim` and `optim_grads` keep whole parameters on every rank; threefold's distributed
  optimizer (`--use-distributed-optimizer` alone) shards as they do. `no_shard` is plain DP.
- Megatron-FSDP v1 requires `--use-distributed-optimizer` and overlaps its gathers and
  reductions under `--overlap-param-gather` / `--overlap-grad-reduce`: FSDP2 shards the
  optimizer state and prefetches and reduces on its own, so those flags are taken as said.
- `--megatron-fsdp-main-params-dtype`: FSDP2 keeps fp32 parameters as the optimizer's.
  `--megatron-fsdp-main-grads-dtype`: FSDP2 accumulates gradients in fp32; a bf16 choice (the
  default under --bf16) runs with fp32 accumulation, and the start-up log says so.
  `--megatron-fsdp-grad-comm-dtype` (default: the main gradients'): bf16 is FSDP2's bf16
  reduce-scatter, as `--grad-reduce-in-bf16` sets it.
- `--outer-dp-sharding-strategy` belongs to hybrid FSDP (`--num-distributed-optimizer-instances`
  > 1), which is not implemented: `no_shard`, its default, is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import arg, given_flags

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPES = ("fp32", "bf16", "fp16", "auto")


@dataclass
class MegatronFsdpConfig:
    use_megatron_fsdp: bool = arg(
        False,
        help="Megatron-LM's FSDP, run as FSDP2 (--distributed-strategy fsdp; "
        "threefold/config/megatron_fsdp.py says what carries over)",
    )
    data_parallel_sharding_strategy: str = arg(
        "optim_grads_params",
        help="with --use-megatron-fsdp: optim_grads_params (ZeRO-3, FSDP2 here); the others "
        "are refused, naming threefold's equivalent",
        choices=SHARDING_STRATEGIES,
    )
    outer_dp_sharding_strategy: str = arg(
        "no_shard",
        help="with --use-megatron-fsdp: hybrid FSDP's outer replicas; only no_shard",
        choices=("no_shard", "optim"),
    )
    megatron_fsdp_main_params_dtype: str = arg(
        "fp32",
        help="with --use-megatron-fsdp: only fp32 (FSDP2's master parameters)",
        choices=DTYPES,
    )
    megatron_fsdp_main_grads_dtype: str = arg(
        "auto",
        help="with --use-megatron-fsdp: gradients accumulate in fp32 whichever is given "
        "(auto: the parameters' dtype)",
        choices=DTYPES,
    )
    megatron_fsdp_grad_comm_dtype: str = arg(
        "auto",
        help="with --use-megatron-fsdp: the reduce-scatter's dtype, fp32 or bf16 (auto: the "
        "main gradients')",
        choices=DTYPES,
    )

    def finalize_megatron_fsdp(self, precision: str) -> list[str]:
        """`--use-megatron-fsdp` as the FSDP2 strategy (`precision`: fp32, bf16 or fp16, the
        run's); returns the start-up notes of what is taken differently."""
        if not self.use_megatron_fsdp:
            given = given_flags(self, MegatronFsdpConfig, _FSDP_ONLY)
            _require(
                not given,
                f"{' '.join(given)} belong{'s' if len(given) == 1 else ''} to Megatron-FSDP: "
                f"add --use-megatron-fsdp or drop {'it' if len(given) == 1 else 'them'}",
            )
            return []
        strategy = self.data_parallel_sharding_strategy
        _require(
            strategy == "optim_grads_params",
            f"--data-parallel-sharding-strategy {strategy} keeps whole parameters on every rank; "
            "threefold has it as "
            + (
                "plain data parallelism: drop --use-megatron-fsdp and --use-distributed-optimizer"
                if strategy == "no_shard"
                else "its distributed optimizer: drop --use-megatron-fsdp, keep "
                "--use-distributed-optimizer"
            ),
        )
        _require(
            self.distributed_strategy == "megatron",
            f"--use-megatron-fsdp runs as --distributed-strategy fsdp; drop "
            f"--distributed-strategy {self.distributed_strategy} (or --use-torch-fsdp2)",
        )
        _require(
            self.num_distributed_optimizer_instances == 1
            and self.outer_dp_sharding_strategy == "no_shard",
            "hybrid FSDP (--num-distributed-optimizer-instances > 1, "
            "--outer-dp-sharding-strategy optim) is not implemented; drop them",
        )
        main_params = _resolve(self.megatron_fsdp_main_params_dtype, precision)
        _require(
            main_params == "fp32",
            f"--megatron-fsdp-main-params-dtype {self.megatron_fsdp_main_params_dtype}: FSDP2 "
            "keeps fp32 master parameters here; pass fp32 or drop the flag",
        )
        main_grads = _resolve(self.megatron_fsdp_main_grads_dtype, precision)
        comm = _resolve(self.megatron_fsdp_grad_comm_dtype, main_grads)
        _require(
            comm == "fp32" or (comm == "bf16" and precision == "bf16"),
            f"--megatron-fsdp-grad-comm-dtype {comm}: FSDP2 reduce-scatters in fp32, or in "
            "bf16 under --bf16; pass one of those",
        )
        notes = [
            "--use-megatron-fsdp runs as FSDP2 (--distributed-strategy fsdp), ZeRO-3 as "
            "optim_grads_params is"
        ]
        taken = [
            flag
            for flag, on in (
                ("--use-distributed-optimizer", self.use_distributed_optimizer),
                ("--overlap-grad-reduce", self.overlap_grad_reduce),
                ("--overlap-param-gather", self.overlap_param_gather),
            )
            if on
        ]
        if taken:
            notes.append(
                f"{' '.join(taken)} with --use-megatron-fsdp: FSDP2 shards the optimizer state, "
                "prefetches the next layer's all-gather and reduce-scatters as each layer's "
                "backward ends, on its own"
            )
        if main_grads != "fp32":
            notes.append(
                f"--megatron-fsdp-main-grads-dtype {main_grads}: FSDP2 accumulates gradients in "
                "fp32 here (Megatron-FSDP would keep them in " + main_grads + ")"
            )
        self.distributed_strategy = "fsdp"
        self.use_distributed_optimizer = False
        self.overlap_grad_reduce = self.overlap_param_gather = False
        self.grad_reduce_in_bf16 |= comm == "bf16"
        return notes


def _resolve(dtype: str, native: str) -> str:
    return native if dtype == "auto" else dtype


# every field but the switch itself
_FSDP_ONLY = tuple(MegatronFsdpConfig.__dataclass_fields__)[1:]
