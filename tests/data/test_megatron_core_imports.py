"""threefold/data/megatron_core.py: megatron-core's dataset modules import without the rest of
its package (Inductor's compiler, wandb, the tensor-parallel layers); code that then wants the
whole package gets it. In a fresh interpreter: the test process imports megatron-core whole."""

import subprocess
import sys
import warnings

from tests.conftest import ROOT
from threefold.data import megatron_core

UNUSED = ("torch._inductor.compile_fx", "wandb", "megatron.core.tensor_parallel")


def _python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_datasets_import_alone_and_the_rest_of_the_package_when_asked_for():
    """A submodule then imports on its own; a name the package's __init__ defines runs it,
    into the same module, as if it had run at the start."""
    out = _python(
        "import sys\n"
        "from threefold.data import megatron_core\n"
        "datasets = megatron_core.datasets()\n"
        "print(datasets.gpt_dataset.GPTDataset.__module__)\n"
        "print(datasets.indexed_dataset.IndexedDatasetBuilder.__module__)\n"
        f"print(sorted(set({UNUSED!r}) & set(sys.modules)))\n"
        "from megatron.core import tensor_parallel\n"
        "print(tensor_parallel.__name__)\n"
        "import megatron.core\n"
        "package = megatron.core\n"
        "from megatron.core import DistributedDataParallel, __version__\n"
        "print(DistributedDataParallel.__module__, __version__ == megatron.core.package_info"
        ".__version__)\n"
        "print(sys.modules['megatron.core'] is package, megatron.core.mpu.__name__)\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "print('__getattr__' in vars(package))\n"
    )
    assert out.splitlines() == [
        "megatron.core.datasets.gpt_dataset",
        "megatron.core.datasets.indexed_dataset",
        "[]",
        "megatron.core.tensor_parallel",
        "megatron.core.distributed.distributed_data_parallel True",
        "True megatron.core.parallel_state",
        "False",
    ]


def test_an_imported_package_is_left_alone():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
    package = megatron.core
    megatron_core.datasets()
    assert sys.modules["megatron.core"] is package
