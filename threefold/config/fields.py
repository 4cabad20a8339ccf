"""What a config field declares about itself, beside its default: its command-line flag (help
text, choices, ...), and whether a checkpoint carries it. `threefold.arguments` builds the
parser from these declarations; nothing else lists the flags.

    help="..."                the flag's --help text (the default is appended)
    flag="--disable-bias-linear"  the flag when it is not `--field-name`; a boolean field that
                              defaults to True is turned off by its flag (store_false)
    aliases=(...)             more spellings of the same flag
    choices, nargs, metavar   as argparse takes them; `type` only where the annotation's
                              type is not the flag's (--lr-warmup-iters parses an int)
    group="LoRA fine-tuning"  a --help section other than the config's
    cli=False                 no flag (the world size comes from the launcher)
    minimum=1                 the least value the flag takes (`check_minimums`, before any
                              other check: a size of 0 reached a reshape as a traceback, a
                              negative --adam-eps or --init-method-std torch's ValueError)

    checkpoint=ARCHITECTURE   the checkpoint's tensors depend on it, or what they compute: a
                              load refuses a run that differs (checkpoint/load.py), and
                              --use-checkpoint-args takes it from the checkpoint
    checkpoint=MODEL          --use-checkpoint-args takes it from the checkpoint (sequence
                              length, RoPE base, norm epsilon, ...); a load does not check it
    checkpoint=FINETUNING     finetune.py starts from the checkpoint's value (dropout: a
                              converted model records 0, not Megatron's pretraining 0.1)
    flag="--disable-bias-linear"  a boolean whose flag sets it to False (Megatron's spelling)

Every list of such fields is derived from here (`checkpoint_fields`, `as_flags`), so a new
model option is declared once, on its field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from threefold.config.errors import ConfigError

ARCHITECTURE = "architecture"
MODEL = "model"
FINETUNING = "finetuning"


def arg(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    checkpoint: str | None = None,
    flag: str | None = None,
    help: str | None = None,
    cli: bool = True,
    **parser_options: Any,
) -> Any:
    """A dataclass field with its declaration (see the module docstring); `parser_options`:
    aliases, choices, nargs, metavar, type, group."""
    metadata = {"checkpoint": checkpoint, "flag": flag, "help": help, "cli": cli, **parser_options}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_minimums(config: Any) -> None:
    """ConfigError for the first field of `config` given below the `minimum` it declares."""
    for field in dataclasses.fields(config):
        minimum, value = field.metadata.get("minimum"), getattr(config, field.name)
        if minimum is not None and value is not None and not value >= minimum:  # (NaN too)
            raise ConfigError(f"{flag_of(field)} must be >= {minimum}, not {value}")


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def given_flags(config: Any, config_class: type, names: tuple[str, ...] | None = None) -> list[str]:
    """The flags of `config_class`'s fields (those named, or all) that `config` holds at a
    value other than their default: what a refusal names when they belong to a feature that
    is off."""
    return [
        flag_of(field)
        for field in dataclasses.fields(config_class)
        if (names is None or field.name in names) and getattr(config, field.name) != field.default
    ]


def checkpoint_fields(config_class: type, *kinds: str) -> list[dataclasses.Field]:
    """The fields a checkpoint carries of the given kinds, in declaration order."""
    return [f for f in dataclasses.fields(config_class) if f.metadata.get("checkpoint") in kinds]


def as_flags(config_class: type, values: dict, *kinds: str) -> list[str]:
    """Stored values (a config as `dataclasses.asdict` wrote it) as the flags that set them:
    `--name VALUE` (`--name V1 V2 ...` for a list), or a boolean's bare flag when the value is
    not its default."""
    flags = []
    for field in checkpoint_fields(config_class, *kinds):
        value = values.get(field.name)
        if field.type == "bool":  # the flag sets the value that is not the default
            flags += [flag_of(field)] if value is not None and value != field.default else []
        elif isinstance(value, list):  # a flag of nargs
            flags += [flag_of(field), *map(str, value)]
        elif value is not None:
            flags += [flag_of(field), str(value)]
    return flags
