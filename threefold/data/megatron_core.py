"""megatron-core's dataset modules without the rest of megatron-core's package.

`from megatron.core.datasets... import ...` first runs megatron/core/__init__.py, which imports
the tensor-parallel layers, Inductor's compiler (through a fused kernel's module) and wandb
(through the inference contexts): 2.5 s of a 2-core machine's start, in every run that reads
.bin/.idx data and in every preprocess_data.py, for modules the datasets never use (measured in
bench/results/startup.md). `datasets()` registers the package uninitialized, so its submodules
import on their own; the first use of a name only the package's __init__ defines runs that
__init__ then, into the same module object, so code that wants all of megatron-core (a test's
megatron-core model, a contender in bench/) still gets it.

The __init__ also adds megatron-core's classes (argparse.Namespace, numpy arrays, ...) to the
globals every `torch.load(weights_only=True)` in the process accepts; threefold's readers
allow what they read themselves (threefold/safe_loading.py), so a run that skips it accepts
less, never more.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from types import ModuleType

_PACKAGE = "megatron.core"
# In this order: megatron.core.utils and parallel_state import each other, and only starting
# from parallel_state (as the package's __init__ does) finds each name defined when asked for.
_DATASET_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.datasets.utils",
    "megatron.core.datasets.indexed_dataset",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.datasets.blended_megatron_dataset_builder",
)


def _defer_package_init() -> None:
    if _PACKAGE in sys.modules:  # imported (or deferred) already
        return
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None:
        return  # not installed: the import that follows says so
    package = importlib.util.module_from_spec(spec)

    def complete(name: str):
        # `from megatron.core import config` asks the package for the name before importing
        # the submodule; a submodule is imported (or, midway, handed over as Python hands a
        # circular import), anything else is the package's own and needs its __init__.
        submodule = f"{_PACKAGE}.{name}"
        if submodule in sys.modules:
            return sys.modules[submodule]
        if not name.startswith("__") and importlib.util.find_spec(submodule) is not None:
            return importlib.import_module(submodule)
        del package.__getattr__  # the package's own __init__ defines none
        spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = complete
    sys.modules[_PACKAGE] = package
    parent = sys.modules.get("megatron") or importlib.import_module("megatron")
    parent.core = package


def datasets() -> ModuleType:
    """megatron.core.datasets, with its builder, GPT dataset, indexed dataset and utils."""
    _defer_package_init()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _DATASET_MODULES:
            importlib.import_module(name)
    return sys.modules["megatron.core.datasets"]
