"""Dataclass configs, one per concern, each validating itself: a leaf package (torch-free,
importing nothing else of threefold's), below every other.

`threefold.arguments` maps Megatron-LM's flag names onto these; the names of the fields are the
flag names with dashes turned into underscores, so an error can always name the flag to fix.
Validation here needs no model, no data and no process group: it runs before any heavy work.
"""

from threefold.config.checkpoint import CheckpointConfig
from threefold.config.data import TOKENIZERS, DataConfig
from threefold.config.errors import ConfigError, flag
from threefold.config.kernels import KernelConfig
from threefold.config.logging import LoggingConfig
from threefold.config.model import ModelConfig
from threefold.config.parallel import STRATEGIES, ParallelConfig, stage_layer_counts
from threefold.config.run import Config
from threefold.config.training import TrainingConfig

__all__ = [
    "TOKENIZERS",
    "STRATEGIES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "KernelConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainingConfig",
    "flag",
    "stage_layer_counts",
]
