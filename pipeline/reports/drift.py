"""Weight drift: the fraction of a checkpoint's weights that are bit-identical to its initializer, per layer.

Reads the safetensors files themselves (header + raw bytes, memory-mapped), so it needs no torch and
compares every dtype (bf16 included) exactly: an element is unchanged when its bytes are. Adam with
no weight decay leaves a parameter bit-identical until it first gets a non-zero gradient, so in a
mixture of experts the unchanged fraction is mostly the experts the router never sent a trained
token to (the seed model card: 86% unchanged after 36 RL updates).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json

_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = read_json(model_dir / "model.safetensors.index.json")
    if index is None:
        raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    return [model_dir / name for name in sorted(set(index["weight_map"].values()))]


def tensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """name -> the tensor's elements as unsigned integers of its width (memory-mapped, never decoded)."""
    out = {}
    for path in _files(Path(model_dir)):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            width = _BYTES.get(info["dtype"], 1)
            out[name] = data[lo:hi].view(f"<u{width}") if width > 1 else data[lo:hi]
    return out


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: `layers.<i>` for a decoder layer's, else the tensor's own name."""
    m = _LAYER.match(name)
    return f"layers.{m.group(1)}" if m else name.removeprefix("model.").removesuffix(".weight")


def weight_drift(checkpoint: str | Path, initial: str | Path) -> dict:
    """{"unchanged": fraction of all elements, "layers": {layer: fraction}, "tensors": {name: fraction},
    "elements": count}; tensors absent from either side or reshaped are listed under "mismatched"."""
    after, before = tensors(checkpoint), tensors(initial)
    same, total = {}, {}
    per_tensor, mismatched = {}, sorted(set(after) ^ set(before))
    for name in sorted(set(after) & set(before)):
        a, b = after[name], before[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            mismatched.append(name)
            continue
        equal = int(np.count_nonzero(a == b))
        per_tensor[name] = equal / a.size if a.size else 1.0
        layer = layer_of(name)
        same[layer] = same.get(layer, 0) + equal
        total[layer] = total.get(layer, 0) + a.size
    elements = sum(total.values())
    return {
        "unchanged": sum(same.values()) / elements if elements else None,
        "elements": elements,
        "layers": {k: same[k] / total[k] if total[k] else 1.0 for k in sorted(total, key=_layer_order)},
        "tensors": per_tensor,
        "mismatched": mismatched,
    }


def _layer_order(layer: str) -> tuple:
    m = re.fullmatch(r"layers\.(\d+)", layer)
    return (1, int(m.group(1)), "") if m else (0 if "embed" in layer else 2, 0, layer)
