"""What a launcher's own settings mean for a threefold run.

`accelerate launch` starts pretrain_gpt.py with torchrun's environment (that part just works)
and passes its own settings (`--mixed_precision`, `--use_fsdp`, `--use_deepspeed`,
`--dynamo_backend`) as ACCELERATE_* variables that only `accelerate.Accelerator` reads.
threefold does not use an Accelerator, so each such setting would silently do nothing: one that
asks for something the command line does not is refused, naming threefold's flag for it.
"""

from __future__ import annotations

import os

from threefold.config import Config, ConfigError

# accelerate's mixed-precision names -> threefold's precision flag
_PRECISION_FLAGS = {"bf16": "--bf16", "fp16": "--fp16", "fp8": "--fp8-format"}


def _set(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def check_accelerate_settings(config: Config) -> None:
    """Raise ConfigError for an `accelerate launch` setting the run would ignore."""
    precision = _set("ACCELERATE_MIXED_PRECISION")
    if precision not in ("", "no"):
        asked = {"bf16": config.training.bf16, "fp16": config.training.fp16}.get(precision)
        if not asked:
            raise ConfigError(
                f"accelerate launch --mixed_precision {precision} does not reach "
                "pretrain_gpt.py (it configures an accelerate.Accelerator, which threefold "
                f"does not use); pass {_PRECISION_FLAGS.get(precision, '--bf16')} to "
                "pretrain_gpt.py, or --mixed_precision no to accelerate"
            )
    wrapped = {
        "ACCELERATE_USE_FSDP": "--use_fsdp: pass --use-torch-fsdp2 to pretrain_gpt.py",
        "ACCELERATE_USE_DEEPSPEED": (
            "--use_deepspeed: pass --use-distributed-optimizer (ZeRO-1) or --use-torch-fsdp2 "
            "(ZeRO-3) to pretrain_gpt.py"
        ),
    }
    for variable, instead in wrapped.items():
        if _set(variable) == "true":
            raise ConfigError(
                f"accelerate launch {instead} (accelerate's wrapper does not reach threefold's "
                "model); launch with --multi_gpu"
            )
    dynamo = _set("ACCELERATE_DYNAMO_BACKEND")
    if dynamo not in ("", "no"):
        raise ConfigError(
            f"accelerate launch --dynamo_backend {dynamo} does not reach pretrain_gpt.py; "
            "threefold compiles its own kernels (--transformer-impl, the `> kernels:` line): "
            "pass --dynamo_backend no"
        )
