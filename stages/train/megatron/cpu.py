"""What megatron-core needs to run without a GPU (tests, CPU demos): every workaround in one place.

`apply()` is called before a Megatron model is built and does nothing when CUDA is available: the
GPU path runs megatron-core unpatched. Each patch below says which CUDA assumption it answers. A
release that moves one of these shows up as a failing Megatron test here, not as a silent change.
Facts: ../shared/notes/megatron-cpu.md (megatron-core 0.16.1, torch 2.13 CPU, gloo).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core.fusions import fused_softmax
from megatron.core.models import backends
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import utils
from megatron.core.transformer.moe import moe_utils

_applied = False


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """Tensors asked for on device "cuda" by name are made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def construction_context():
    """Around building a GPTModel: with a tied embedding split over pipeline stages, the last
    stage's copy is moved with `.cuda()` before the stages agree on it; here it stays on the CPU."""
    if torch.cuda.is_available():
        yield
        return
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def schedule_context():
    """Around megatron's pipeline schedules, which count tokens in a tensor made on device "cuda" by
    name: that tensor on the CPU. Scoped to the schedule call (a function mode sees every torch call
    while it is on); nothing on a GPU."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaAsCpu()


class _Stream:
    """Stands in for torch.cuda.Stream/Event: on the CPU every operation is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _Stream()

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _MarkedNorm:
    """torch's RMSNorm/LayerNorm as megatron's layer specs build norms, its weight marked
    `sequence_parallel` when the config is."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        kind = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = kind(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _list_splits(all_to_all_single):
    """gloo takes all-to-all split sizes only as Python lists; the token dispatcher passes tensors."""

    @functools.wraps(all_to_all_single)
    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        def as_list(s):
            return s.tolist() if hasattr(s, "tolist") else s

        return all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    return wrapper


def apply() -> None:
    """Patch what megatron-core assumes of CUDA, once per process, only where there is no GPU."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _applied = True
    # Layers are built on torch.cuda.current_device(), and buffers allocated there: the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # The all-to-all token dispatcher copies split sizes to the host on a side stream, and the
    # pipeline schedules synchronise streams: there is only one order of work on the CPU.
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Stream
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    dist.all_to_all_single = _list_splits(dist.all_to_all_single)
    # 0.16.1 calls Transformer Engine's te_general_gemm in the router when TE is absent (the import
    # fallback leaves a name that is not None): the plain matmul path is the one without TE.
    moe_utils.te_general_gemm = None

    # The attention's causal mask is built on device "cuda" by name (not via current_device).
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = causal_mask
    # Without Transformer Engine or apex the layer specs take torch's norm, which refuses sequence
    # parallelism only because nothing marks its weight for the tensor-parallel gradient reduction.
    # Marked here (the trainer reduces marked gradients over the TP group: sequence slices, and the
    # q/k norms each rank applies to its own heads).
    gpt_layer_specs.LNImpl = backends.LNImpl = _MarkedNorm
    backends.LocalSpecProvider.layer_norm = lambda self, rms_norm=False, for_qk=False: _MarkedNorm
    # Dropout regions fork a CUDA generator per tensor-parallel rank. The trainer runs without
    # dropout and initialises on the CPU, so the tracker that forks nothing (Megatron's inference
    # tracker) is exact here.
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
