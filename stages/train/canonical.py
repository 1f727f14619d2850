"""`torch.save` whose bytes depend on the values saved, not on how the objects came to be.

Pickle writes an object a second time as a back-reference only when it is the *same* object (by
id). A trainer state built by a run differs in object identity from one loaded from a checkpoint
(the interned key "step" of every AdamW state vs. the strings the unpickler made; tuples shared
between param groups or not), so an equal state pickled to other bytes after a resume. Rebuilding
every container and interning every string before saving makes the identities canonical. A tensor
that is a view into a larger storage (a gathered shard's buffer, padded) is saved compact: pickle
records its storage's size, so the same values would otherwise give other bytes.
"""

from __future__ import annotations

import sys

import torch


def canonical(obj):
    """A copy of nested dicts/lists/tuples with every container fresh and every str interned.
    Leaves (tensors, arrays, numbers) are not copied, except a tensor that does not own its whole
    storage: a tensor's storage is written once either way."""
    kind = type(obj)  # exact types: a subclass (OrderedDict, a namedtuple) must keep its class
    if kind is str:
        return sys.intern(obj)
    if kind is torch.Tensor and (obj.storage_offset() or obj.untyped_storage().nbytes() != obj.numel() * obj.element_size()):
        return obj.clone(memory_format=torch.contiguous_format)
    if kind is dict:
        return {canonical(k): canonical(v) for k, v in obj.items()}
    if kind is list:
        return [canonical(v) for v in obj]
    if kind is tuple:
        return tuple(canonical(v) for v in obj)
    return obj


def save(obj, path) -> None:
    torch.save(canonical(obj), path)
