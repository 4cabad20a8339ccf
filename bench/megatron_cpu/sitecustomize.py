"""Megatron-LM's own entry points, unchanged, on gloo CPU ranks (bench/megatron_training.py).

With this folder first on PYTHONPATH and THREEFOLD_MEGATRON_LM naming a Megatron-LM checkout,
every Python process that starts (torchrun's workers, and the processes its checkpoint writer
spawns, which import pretrain_gpt.py afresh) gets, before the checkout's first import:
bench/megatron_saved_models.py's stand-ins (GPU-only libraries as empty modules; Transformer
Engine, apex and ModelOpt absent; `.cuda()`, tensors made on "cuda" and CUDA's synchronize
the CPU's), and what the training loop adds to the forward pass: CUDA's streams and events
(everything on the CPU is in order already), its random state (dropout is 0: nothing draws
from it), memory counters (0), `Tensor.to("cuda")` and the "torch.cuda.FloatTensor" type
names its optimizer checks for. Two of its start-up checks (CUDA is available; a device to
set) are told yes, and only they: anything else that asks is told there is no CUDA.
Without THREEFOLD_MEGATRON_LM it does nothing.
"""

import os
import sys


def _on_cpu(factory):
    def make(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _Stream:
    """CUDA's streams and events: waits, records and synchronizations are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def query(self) -> bool:
        return True

    def record_event(self, *args, **kwargs) -> "_Stream":
        return _Stream()  # (the alltoall dispatcher synchronizes on it)

    def elapsed_time(self, other) -> float:
        return 0.0


def _told_yes(answer, caller: str):
    """`answer`, but 1 (a device; CUDA is there) for the function named `caller`."""

    def ask(*args, **kwargs):
        return 1 if sys._getframe(1).f_code.co_name == caller else answer(*args, **kwargs)

    return ask


def _compile_helpers() -> None:
    """Megatron-LM's dataset helpers built for this interpreter (its Makefile asks the
    system's `python3`, which may be another one): pybind11 from this environment."""
    import glob
    import subprocess
    import sysconfig

    from megatron.core import datasets

    folder = os.path.dirname(datasets.__file__)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if glob.glob(os.path.join(folder, f"helpers_cpp{suffix}")):
        return
    import pybind11  # (pip install pybind11)

    command = ["c++", "-O3", "-shared", "-std=c++17", "-fPIC", "-I" + pybind11.get_include()]
    command += ["-I" + sysconfig.get_paths()["include"], os.path.join(folder, "helpers.cpp")]
    subprocess.run(command + ["-o", os.path.join(folder, f"helpers_cpp{suffix}")], check=True)


def _load_with_torch_adam() -> None:
    """Its distributed optimizer's --load, with torch's AdamW (no apex nor Transformer Engine
    here, where its code keeps `step` otherwise): the load reads the optimizer's `step` from
    its state before filling it, and a fresh AdamW has none yet, so it takes the dummy step
    its FSDP path takes first (zero gradients; the load then replaces the weights and the
    whole state)."""
    from megatron.core.optimizer import distrib_optimizer

    sharded = distrib_optimizer.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_state_dict=None, is_loading: bool = False, **kwargs):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return sharded(self, model_state_dict or {}, is_loading, **kwargs)

    distrib_optimizer.DistributedOptimizer.sharded_state_dict = sharded_state_dict
    # AdamW's per-parameter `step`, which its loaders leave out of what they set ("handled
    # separately": from the saved param groups), but then look for; and, in fp32, the main
    # parameters are views of the model's, which only its fully reshardable loader copies
    # into under no_grad (its DP-reshardable one is not decorated so)
    set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    class _LeftOut(dict):
        def __missing__(self, key):
            return None

    @torch.no_grad()
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        return set_states(self, model_param, _LeftOut(tensors))

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = (
        set_main_param_and_optimizer_states
    )
    # and its load means to give each parameter's AdamW state the saved param groups' `step`
    # ("native PyTorch state dict requires step"), yet after it each parameter's is still the
    # dummy step's 1: Adam's bias correction would be another step's (its resume of its own
    # checkpoint then left its uninterrupted run at the first step)
    load_state_dict = distrib_optimizer.DistributedOptimizer.load_state_dict

    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for group in self.optimizer.param_groups:
            for param in group["params"] if "step" in group else ():
                if "step" in self.optimizer.state.get(param, {}):
                    self.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))

    distrib_optimizer.DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps


def _alltoall_splits_on_the_host() -> None:
    """Its alltoall dispatcher's split sizes, which it copies from the GPU as NumPy arrays (a
    list is what the collective takes): here already on the host, they stayed tensors."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _norms_under_sequence_parallelism() -> None:
    """Its torch norms (the local spec's without apex or Transformer Engine), which refuse
    --sequence-parallel, the flag it requires of a mixture of experts beside TP: each rank
    normalizes its slice of the sequence, and the weights are marked as its fused norms mark
    theirs (`sequence_parallel`), so that their gradients are summed over TP."""
    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = build(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _apply(checkout: str) -> None:
    import contextlib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "bench"))
    from megatron_saved_models import cpu_stand_ins

    cpu_stand_ins(checkout, "current")
    from megatron.core.datasets import utils
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    # (a Hopper's: its arguments check the architecture; no CUDA here to ask)
    arguments.get_device_arch_version = common_utils.get_device_arch_version = lambda: 9
    utils.compile_helpers = _compile_helpers
    _load_with_torch_adam()
    _alltoall_splits_on_the_host()
    _norms_under_sequence_parallelism()
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.is_available = _told_yes(torch.cuda.is_available, "initialize_megatron")
    torch.cuda.device_count = _told_yes(torch.cuda.device_count, "_initialize_distributed")
    torch.cuda.set_device = torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    for name in ("memory_allocated", "memory_reserved"):
        setattr(torch.cuda, name, lambda *args, **kwargs: 0)
        setattr(torch.cuda, f"max_{name}", lambda *args, **kwargs: 0)
    factories = ("rand", "randn", "randint", "zeros", "empty", "ones", "full", "arange")
    for name in factories + ("as_tensor",):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    to = torch.Tensor.to

    def to_cpu(self, *args, **kwargs):
        args = tuple("cpu" if str(a).startswith("cuda") else a for a in args)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return to(self, *args, **kwargs)

    torch.Tensor.to = to_cpu
    type_name = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = type_name(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name
    torch.Tensor.record_stream = lambda self, *args, **kwargs: None
    torch.cuda.Stream = torch.cuda.Event = _Stream
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.ByteTensor(16)
    torch.cuda.set_rng_state = torch.cuda.manual_seed = lambda *args, **kwargs: None
    torch.cuda.manual_seed_all = lambda *args, **kwargs: None


if os.environ.get("THREEFOLD_MEGATRON_LM"):
    import torch

    _apply(os.environ["THREEFOLD_MEGATRON_LM"])
