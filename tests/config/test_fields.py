"""Every field a checkpoint carries round-trips: config -> checkpoint metadata ->
--use-checkpoint-args flags -> parser -> config, for a value that is not the default. The
fields come from their declarations (config/fields.py), so a new one is covered without being
listed anywhere."""

import contextlib
import dataclasses
import io
import json

import pytest

from threefold.arguments import build_parser, config_from_namespace, parse_args
from threefold.checkpoint.args import model_flags
from threefold.config import Config, ModelConfig
from threefold.config.fields import (
    ARCHITECTURE,
    FINETUNING,
    MODEL,
    as_flags,
    checkpoint_fields,
    flag_of,
)

CARRIED = checkpoint_fields(ModelConfig, ARCHITECTURE, MODEL, FINETUNING)


def _other_value(field: dataclasses.Field):
    """A value of the field that is not its default, valid for its flag."""
    default = getattr(ModelConfig(), field.name)
    action = build_parser()._option_string_actions[flag_of(field)]
    if action.choices:
        return next(choice for choice in action.choices if choice != default)
    if action.nargs == "+":  # a list (the --longrope-*-factor lists: every value kept)
        return [0.1, 2.0 / 3, 1e-7]
    if isinstance(default, bool):
        return not default
    if action.type is float:
        return (default or 1.0) * 2 + 0.5
    if isinstance(default, str) or action.type is str:  # free-form (--moe-layer-freq)
        return (default or "") + "2"
    return (default or 0) + 3


def test_the_checkpoint_carries_the_fields_megatron_takes():
    names = {field.name for field in CARRIED}
    assert {
        "num_layers",
        "hidden_size",
        "num_query_groups",
        "swiglu",
        "add_bias_linear",
        "qk_layernorm",
        "seq_length",
        "rotary_base",
        "norm_epsilon",
    } <= names
    assert not names & {"init_method_std", "lora_rank"}
    assert {f.name for f in checkpoint_fields(ModelConfig, FINETUNING)} == {
        "attention_dropout",
        "hidden_dropout",
    }


@pytest.mark.parametrize("field", CARRIED, ids=lambda field: field.name)
def test_every_carried_field_round_trips(field):
    value = _other_value(field)
    config = dataclasses.replace(ModelConfig(), **{field.name: value})
    stored = json.loads(json.dumps(dataclasses.asdict(config)))  # as metadata.json holds it
    # What --use-checkpoint-args takes, and what finetune.py takes besides.
    flags = model_flags(stored) + as_flags(ModelConfig, stored, FINETUNING)
    parsed = config_from_namespace(build_parser().parse_args(flags))
    assert getattr(parsed.model, field.name) == value
    assert {f.name: getattr(parsed.model, f.name) for f in CARRIED} == {
        f.name: getattr(config, f.name) for f in CARRIED
    }


BOUNDED = [
    field
    for part in dataclasses.fields(Config)
    for field in dataclasses.fields(getattr(Config(), part.name))
    if field.metadata.get("minimum") is not None
]


@pytest.mark.parametrize("field", BOUNDED, ids=lambda field: flag_of(field))
def test_every_declared_minimum_is_refused_below_in_one_line(field, capsys):
    """(before, `--seq-length 0`, `--ffn-hidden-size 0` and `--kv-channels 0` reached a reshape
    after start-up, a negative --adam-eps, --init-method-std or --seed torch's or numpy's
    ValueError; `--global-batch-size 0` named the evaluation's flags)"""
    minimum = field.metadata["minimum"]
    below = build_parser()._option_string_actions[flag_of(field)].type(str(minimum - 1))
    argv = ["--mock-data", "--vocab-size", "128", flag_of(field), str(below)]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=1)
    assert exit_info.value.code == 2
    line = f"pretrain_gpt.py: error: {flag_of(field)} must be >= {minimum}, not {below}\n"
    assert capsys.readouterr().err == line


def test_the_sizes_a_run_cannot_do_without_declare_a_minimum():
    declared = {flag_of(field) for field in BOUNDED}
    sizes = ["--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads"]
    sizes += ["--kv-channels", "--seq-length", "--vocab-size", "--micro-batch-size"]
    sizes += ["--global-batch-size", "--tensor-model-parallel-size"]
    assert set(sizes) <= declared


def test_no_numeric_flag_takes_a_negative_value_silently():
    """Every int or float flag refuses -1 (a size, a count, a rate, a scale): by a declared
    minimum or a check of its own. The exceptions are Megatron-LM's flags threefold takes with
    any value and names at start-up (megatron_compat.ANY_VALUE)."""
    from threefold import megatron_compat

    taken = []
    for action in build_parser()._actions:
        single = action.option_strings and action.nargs is None
        if not single or action.type not in (int, float):
            continue
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                parse_args(["--mock-data", "--vocab-size", "128", action.option_strings[0], "-1"])
        except SystemExit:
            continue
        taken.append(action.option_strings[0])
    assert sorted(taken) == sorted(
        f for f, (kind, _) in megatron_compat.ANY_VALUE.items() if kind in (int, float)
    )
