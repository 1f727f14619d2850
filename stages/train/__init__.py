"""Training backend: optimizer/schedule, packed data, loss, train-step backends, checkpoints."""

from .backend import DeepSpeedBackend, StepStats, TorchBackend, load_for_training, local_device, make_backend, world
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_weights, step_name, with_whole_tensors
from .optim import OptimConfig, lr_factor
from .packing import Example, PackedLoader, pack_rows

__all__ = [
    "DeepSpeedBackend",
    "StepStats",
    "TorchBackend",
    "local_device",
    "make_backend",
    "load_for_training",
    "world",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_weights",
    "step_name",
    "with_whole_tensors",
    "OptimConfig",
    "lr_factor",
    "Example",
    "PackedLoader",
    "pack_rows",
]
