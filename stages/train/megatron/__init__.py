"""`trainer.backend: megatron` (megatron-core): see backend.py; layouts in layout.py, conversion in
bridge.py, the CPU workarounds in cpu.py. Importing this package does not import megatron-core."""

import warnings

from snowcat.stages.model.layout import Layout

# megatron-core says on import, once per module, that the optional fused kernels are absent; the
# backend picks its path itself (cpu.py, bridge.py), so these lines only bury the stage's log
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)


def __getattr__(name):  # megatron-core loads only when a backend is made
    if name in ("MegatronBackend", "megatron_backend"):
        from . import backend

        return getattr(backend, name)
    raise AttributeError(name)


__all__ = ["Layout", "MegatronBackend", "megatron_backend"]
