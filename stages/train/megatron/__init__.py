"""`trainer.backend: megatron` (megatron-core): see backend.py; layouts in layout.py, conversion in
bridge.py, the CPU workarounds in cpu.py. Importing this package does not import megatron-core."""

from .layout import Layout


def __getattr__(name):  # megatron-core loads only when a backend is made
    if name in ("MegatronBackend", "megatron_backend"):
        from . import backend

        return getattr(backend, name)
    raise AttributeError(name)


__all__ = ["Layout", "MegatronBackend", "megatron_backend"]
