"""Every flag Megatron-LM's command line takes, from a checkout, into
tests/data/megatron_flags.txt: the list tests/test_megatron_compat.py holds threefold's parser
to (each flag taken, or named in one line as a feature threefold lacks; never argparse's
"unrecognized arguments").

    python bench/megatron_flags.py MEGATRON_LM_CHECKOUT

Megatron-LM builds much of its parser from dataclasses, so the flags are read from its parser
itself: `megatron.training.arguments.parse_args` runs up to the parse, which is stopped there.
The checkout's modules that need a GPU library (Transformer Engine, Triton kernels, ...) are
stood in for by empty modules: only the argument definitions are wanted.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "megatron_flags.txt")
# what a CPU machine lacks; a module named here, and those below it, import as stand-ins
STAND_INS = (
    "apex",
    "causal_conv1d",
    "cuda",
    "emerging_optimizers",
    "fla",
    "flash_attn",
    "flashinfer",
    "mamba_ssm",
    "modelopt",
    "nv_one_logger",
    "nvidia_resiliency_ext",
    "nvtx",
    "tensorstore",
    "transformer_engine",
    "wandb",
    "zarr",
    # Megatron-LM's own Triton kernels (Triton itself must stay absent: torch looks for it)
    "megatron.core.ssm.ops.common.causal_conv1d_varlen",
    "megatron.core.ssm.ops.mamba2.batch_invariant_decode",
    "megatron.core.transformer.moe.ops.paged_stash",
)


class _Anything:
    """Whatever a stand-in module is asked for: callable, indexable, empty when iterated, a
    decorator that returns what it decorates."""

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __mro_entries__(self, bases):
        return (object,)


ANYTHING = _Anything()


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name == "__version__":
            return "99.0.0"
        if name.startswith("__"):
            raise AttributeError(name)
        return ANYTHING


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == m or name.startswith(m + ".") for m in STAND_INS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


class _Parsed(Exception):
    pass


def megatron_flags(checkout: str) -> list[str]:
    """The option strings of the parser Megatron-LM's `parse_args` builds."""
    import typing

    import typing_extensions

    typing.override = getattr(typing, "override", typing_extensions.override)  # (Python 3.12's)
    sys.path.insert(0, checkout)
    sys.meta_path.insert(0, _StandIns())
    from megatron.training import arguments

    found: set[str] = set()

    def collect(parser, *args, **kwargs):
        for action in parser._actions:
            found.update(action.option_strings)
        raise _Parsed

    argparse.ArgumentParser.parse_args = collect
    argparse.ArgumentParser.parse_known_args = collect
    sys.argv = ["pretrain_gpt.py"]
    try:
        arguments.parse_args()
    except _Parsed:
        pass
    return sorted(f for f in found if f.startswith("--") and f != "--help")


def main() -> None:
    checkout = sys.argv[1]
    commit = subprocess.run(
        ["git", "-C", checkout, "log", "-1", "--format=%H (%cs)"], capture_output=True, text=True
    ).stdout.strip()
    flags = megatron_flags(checkout)
    with open(OUT, "w") as f:
        f.write(f"# Megatron-LM {commit}: python bench/megatron_flags.py CHECKOUT\n")
        f.write("\n".join(flags) + "\n")
    print(f"{len(flags)} flags -> {os.path.relpath(OUT)}")


if __name__ == "__main__":
    main()
