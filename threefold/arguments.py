"""Megatron-LM's command line, parsed into threefold's dataclass configs.

Flag names, defaults and meanings follow Megatron-LM so that an existing launch script runs.
Every flag is declared once, on its config field (threefold/config/fields.py); the parser is
built from those declarations, and a flag's destination is `<config>.<field>`. An unknown
flag is an argparse error that names it (exit code 2), never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

from threefold import megatron_compat, megatron_missing
from threefold.checkpoint.args import flags_for_use_checkpoint_args
from threefold.config import Config, ConfigError
from threefold.config.fields import flag_of


class ToolParser(argparse.ArgumentParser):
    """A command line whose mistakes come in one line, not after the usage block; a mistyped
    flag gets the nearest real one. Under torchrun, local rank 0 says it for its machine."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # as Megatron-LM: a flag's prefix is not that flag
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1).split("=")[0]
            near = difflib.get_close_matches(flag, list(self._option_string_actions), n=1)
            if near:
                message += f"; did you mean {near[0]}?"
        if unknown or message.startswith("the following arguments are required"):
            message += " (--help lists every flag)"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def exit(self, status: int = 0, message: str | None = None):
        if status and message and not speaks_for_its_machine():
            message = None  # the same refusal, printed by local rank 0
            _let_local_rank_zero_speak()
        super().exit(status, message)


class _Parser(ToolParser):
    """Megatron-LM's command line: a Megatron-LM flag threefold lacks is named with its
    feature."""

    def error(self, message: str):
        missing = _megatron_feature(message)
        if missing:
            self.exit(2, f"{self.prog}: error: {missing}\n")
        super().error(message)


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse `type=` for a tool's count or size: a number of `kind` above 0 (NaN
    refused), else argparse's one line, `argument --workers: give a positive number, not 0`."""

    def parse(text: str):
        value = kind(text)  # a ValueError: argparse's "invalid int value: 'x'"
        if not value > 0:
            raise argparse.ArgumentTypeError(f"give a positive number, not {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _megatron_feature(message: str) -> str | None:
    """argparse's refusal of a Megatron-LM flag (or choice) threefold knows it lacks, as one
    line naming the features instead."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        flags = [word.split("=")[0] for word in unknown.group(1).split() if word.startswith("--")]
        named = {flag: megatron_missing.missing_feature(flag) for flag in flags}
        if not any(named.values()):
            return None
        features = dict.fromkeys(feature for feature in named.values() if feature)
        others = [flag for flag, feature in named.items() if feature is None]
        flags_of = {f: [flag for flag, g in named.items() if g == f] for f in features}
        listed = "; ".join(f"{' '.join(flags_of[f])}: {f}" for f in features)
        tail = f" (also unknown: {' '.join(others)})" if others else ""
        return (
            f"Megatron-LM features threefold does not have - {listed}; drop those flags"
            f"{tail} (docs/megatron_compat.md)"
        )
    choice = re.match(r"argument (--[\w-]+)(?:/\S+)?: invalid choice: '([^']*)'", message)
    if choice and (choice.group(1), choice.group(2)) in megatron_missing.MISSING_CHOICES:
        feature = megatron_missing.MISSING_CHOICES[(choice.group(1), choice.group(2))]
        return (
            f"{choice.group(1)} {choice.group(2)}: {feature}, a Megatron-LM feature threefold "
            "does not have (docs/megatron_compat.md)"
        )
    return None


def speaks_for_its_machine() -> bool:
    """Under torchrun every rank reaches a command-line or input refusal before any process
    group exists, each with the same line: local rank 0 prints it, once per machine."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _let_local_rank_zero_speak() -> None:
    # torchrun stops every worker as soon as one fails: a silent rank that failed first would
    # take local rank 0 down before it printed the line.
    time.sleep(3)


def print_refusal(prog: str, error: Exception | str) -> None:
    if speaks_for_its_machine():
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    else:
        _let_local_rank_zero_speak()


# The --help sections, one per config, in this order.
_SECTIONS = {
    "model": "model",
    "parallel": "parallelism",
    "kernels": "kernels (threefold/kernels; chosen at start-up and logged)",
    "fp8": "FP8 training",
    "training": "training",
    "data": "data",
    "checkpoint": "checkpointing",
    "logging": "logging",
}


def finite(text: str) -> float:
    """A float flag's `type=`: a finite number. NaN and infinity are no setting of any flag;
    taken, they came back later as a loss gone NaN or an integer conversion's traceback
    (--moe-expert-capacity-factor inf, --distributed-timeout-minutes inf)."""
    value = float(text)  # a ValueError: argparse's "invalid float value: 'x'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"give a finite number, not {text}")
    return value


finite.__name__ = "float"  # (argparse names the type in "invalid float value")
_TYPES = {"int": int, "float": finite, "str": str}


def _help(field: dataclasses.Field) -> str | None:
    """The field's help text and, where it says something, its default."""
    text = field.metadata.get("help") or ""
    default = (
        field.default_factory()
        if field.default_factory is not dataclasses.MISSING
        else field.default
    )
    if field.type != "bool" and default not in (None, [], "") and "default" not in text:
        text = f"{text} (default: {default})" if text else f"default: {default}"
    return text.replace("%", "%%") or None


def _argument(concern: str, field: dataclasses.Field) -> tuple[list[str], dict]:
    """The flag(s) and argparse options a config field declares (config/fields.py)."""
    metadata = field.metadata
    names = [flag_of(field), *metadata.get("aliases", ())]
    options = {
        "dest": f"{concern}.{field.name}",
        "default": argparse.SUPPRESS,
        "help": _help(field),
    }
    if field.type == "bool":  # the flag sets the value that is not the default
        options["action"] = "store_false" if field.default is True else "store_true"
        return names, options
    kind = field.type.split(" | ")[0]
    if kind.startswith("list["):
        options["nargs"], kind = "+", kind[len("list[") : -1]
    options["type"] = metadata.get("type") or _TYPES[kind]
    options.update(
        {
            key: metadata[key]
            for key in ("choices", "nargs", "metavar")
            if metadata.get(key) is not None
        }
    )
    if "choices" not in options:
        options.setdefault("metavar", field.name.upper())
    return names, options


def build_parser(
    prog: str = "pretrain_gpt.py",
    description: str = "threefold: Megatron-style 3D-parallel GPT pretraining",
    own_flags: argparse.ArgumentParser | None = None,
) -> argparse.ArgumentParser:
    """Every config field's flag, as the field declares it, then Megatron-LM's aliases; an
    entry point's `own_flags` (a parser without help) come first in --help."""
    parser = _Parser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[own_flags] if own_flags is not None else [],
    )
    sections: dict[str, argparse._ArgumentGroup] = {}
    config = Config()
    for concern, title in _SECTIONS.items():
        for field in dataclasses.fields(getattr(config, concern)):
            if not field.metadata.get("cli", True):
                continue
            section = field.metadata.get("group") or title
            if section not in sections:
                sections[section] = parser.add_argument_group(section)
            names, options = _argument(concern, field)
            sections[section].add_argument(*names, **options)
    megatron_compat.add_flags(parser)
    return parser


def config_from_namespace(namespace: argparse.Namespace) -> Config:
    """The config the flags set; the compatibility flags are left to `megatron_compat.check`."""
    config = Config()
    for dest, value in vars(namespace).items():
        concern, name = dest.split(".", 1)
        if concern != "compat":
            setattr(getattr(config, concern), name, value)
    return config


def _launched_world_size(given: int | None) -> int:
    """The processes of the job: `given`, else the launcher's WORLD_SIZE (1 without one)."""
    text = os.environ.get("WORLD_SIZE", "1") if given is None else str(given)
    if not (text.isascii() and text.isdigit() and int(text) >= 1):
        raise ConfigError(
            f"WORLD_SIZE {text!r}: the job must have at least one process (a launcher's "
            "NNODES x NPROC_PER_NODE)"
        )
    return int(text)


def _megatron_layout_or_not(config: Config) -> None:
    """--ckpt-format torch_dist saves Megatron-LM's layout where it holds the run's state;
    otherwise threefold's, said here (Megatron-LM's launch scripts pass it whatever they run)."""
    from threefold.checkpoint.megatron.training_save import blocker

    reason = blocker(config)
    if reason is not None:
        print(
            f"WARNING: --ckpt-format torch_dist: checkpoints are saved in threefold's format "
            f"(docs/checkpoints.md), not Megatron-LM's: {reason}",
            flush=True,
        )
        config.checkpoint.ckpt_format = "threefold"


def parse_args(
    argv: Sequence[str] | None = None, world_size: int | None = None, prog: str = "pretrain_gpt.py"
) -> Config:
    """Parse Megatron-LM flags and validate them; exits with code 2 and one line on a mistake,
    which names the entry point `prog`."""
    parser = build_parser(prog)
    namespace = parser.parse_args(argv)
    if getattr(namespace, "checkpoint.use_checkpoint_args", False):
        # The checkpoint's flags go first so that the command line's own values win.
        try:
            prefix, note = flags_for_use_checkpoint_args(
                getattr(namespace, "checkpoint.load", None),
                getattr(namespace, "checkpoint.save", None),
                with_tokenizer=not hasattr(namespace, "data.tokenizer_type")
                and getattr(namespace, "checkpoint.use_tokenizer_model_from_checkpoint_args", True),
                pretrained=getattr(namespace, "checkpoint.pretrained_checkpoint", None),
            )
        except ConfigError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        print(f"> {note}", flush=True)
        namespace = parser.parse_args(prefix + list(sys.argv[1:] if argv is None else argv))
    config = config_from_namespace(namespace)
    try:
        config.parallel.world_size = _launched_world_size(world_size)
        for note in megatron_compat.check(
            {dest: value for dest, value in vars(namespace).items() if dest.startswith("compat.")}
        ):
            print(f"> {note}", flush=True)
        for warning in config.finalize():
            print(f"WARNING: {warning}", flush=True)
        if config.checkpoint.ckpt_format == "torch_dist" and config.checkpoint.save:
            _megatron_layout_or_not(config)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return config
