"""The three dtypes of a trainer, each stated (docs/training.md, "Precision"):

- master: the trained parameters and the optimizer's moments. float32 unless the config asks for
  bfloat16: AdamW's update at RL's learning rates (5e-7) is far below a bf16 weight's spacing
  (2^-8 relative), so bf16 masters leave most weights bit-identical, step after step.
- compute: what the forward and backward compute in. `auto`: bf16 autocast on a GPU, float32 on
  the CPU (deterministic there); the masters stay as they are, autocast casts per operation.
- storage: what model directories hold for others to read (`final/`, weight versions handed to
  the rollout engines). `auto`: the dtype the stage's starting checkpoint is stored in, so a
  checkpoint from the hub (bf16) stays bf16 on disk. Resumable checkpoints hold the masters, so a
  resumed run is the uninterrupted one bit for bit whatever the storage dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from snowcat.pipeline.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    master: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    storage: torch.dtype = torch.float32

    def autocast(self, device: torch.device):
        """The forward's context: autocast when compute differs from the masters."""
        if self.compute == self.master:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute)

    def record(self) -> dict[str, str]:
        return {"master": dtype_name(self.master), "compute": dtype_name(self.compute), "storage": dtype_name(self.storage)}


FP32 = Precision()  # all three float32: the CPU default of a model stored in float32


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere oneDNN emulates it,
    slower than float32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve(cfg, device: torch.device, stored: torch.dtype, where: str) -> Precision:
    """The Precision of trainer config `cfg` (its master_dtype, compute_dtype, storage_dtype) on
    `device`, `stored` being the dtype of the stage's starting checkpoint. UserError naming the key
    `where`.<key> for a compute dtype the device cannot do."""
    master = DTYPES[cfg.master_dtype]
    if cfg.compute_dtype == "auto":
        compute = torch.bfloat16 if device.type == "cuda" else master
    else:
        compute = DTYPES[cfg.compute_dtype]
    if compute == torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16():
        raise UserError(f"{where}.compute_dtype: bfloat16 on a CPU without native bf16 (AVX512-BF16 or AMX); use float32")
    storage = stored if cfg.storage_dtype == "auto" else DTYPES[cfg.storage_dtype]
    return Precision(master=master, compute=compute, storage=storage)


def stored_dtype(path) -> torch.dtype:
    """The dtype a model directory (ours or a Hugging Face checkpoint) stores its weights in."""
    from snowcat.stages.model.io import WeightReader, load_model_config  # noqa: PLC0415 (torch model code)

    with WeightReader(path, load_model_config(path)) as weights:
        return weights.dtype()


def unchanged_fraction(before: Path, after: Path, cfg) -> dict[str, float]:
    """Per tensor kind (attention, experts, router, embeddings, head, norms), the fraction of
    `after`'s weights bit-identical to `before`'s once both are in `after`'s stored dtype: the
    seeds' statistic of how much of a model an update really moved. One weight in memory at a time."""
    from snowcat.stages.model.io import WeightReader, distinct_tensors, skeleton  # noqa: PLC0415 (torch model code)

    same: dict[str, int] = {}
    total: dict[str, int] = {}
    with WeightReader(before, cfg) as a, WeightReader(after, cfg) as b:
        dtype = b.dtype()
        for name, t in distinct_tensors(skeleton(cfg)):
            kind = tensor_kind(name)
            x, y = a.rows(name, 0, t.shape[0]).to(dtype), b.rows(name, 0, t.shape[0])
            same[kind] = same.get(kind, 0) + int((x == y).sum())
            total[kind] = total.get(kind, 0) + y.numel()
    fractions = {k: same[k] / total[k] for k in sorted(total)}
    fractions["all"] = sum(same.values()) / max(1, sum(total.values()))
    return fractions


def tensor_kind(name: str) -> str:
    if ".mlp.experts" in name or ".shared_expert" in name:
        return "experts"
    if ".mlp.gate." in name or "router" in name:
        return "router"
    if name.endswith("norm.weight"):
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "head"
    return "mlp"
