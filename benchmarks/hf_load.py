"""Peak memory of loading a Hugging Face checkpoint, side by side: streaming vs read-all-then-copy.

    snowcat bench hf_load [--hidden 512 --layers 8 --experts 16] [--json FILE]

Writes a random Qwen3-MoE checkpoint (transformers' own save_pretrained, sharded), then loads it in
two fresh processes and reports each one's peak resident memory (VmHWM) above the interpreter with
torch and snowcat imported, as a multiple of the checkpoint's weight bytes:
  - `streaming`: `stages.model.load_model_dir` (shard by shard, tensors placed once, assign);
  - `read_all_copy`: what loading did before: every shard read (`safetensors.torch.load_file`), the
    model built (and initialised) normally, the weights copied in by `load_state_dict`.
One copy of the weights is 1.0. The streaming load's overhead above 1.0 is one shard's pages of the
memory-mapped file and one layer's expert pieces (small against a real checkpoint's size; large
against this small one), plus allocator slack.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from snowcat.benchmarks import run_python
from snowcat.pipeline.fsio import atomic_write_json

CHILD = r"""
import json, sys, torch
from pathlib import Path


def hwm_kib():  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")))


from snowcat.stages.model import MoEForCausalLM
from snowcat.stages.model.io import load_hf_state_dict, load_model_config, load_model_dir
before = hwm_kib()  # after every import: only the load counts
path, how = Path(sys.argv[1]), sys.argv[2]
if how == "streaming":
    model = load_model_dir(path)[0]
else:  # what loading did before: every shard read, the model built (initialised), the weights copied in
    from safetensors.torch import load_file
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    model = MoEForCausalLM(load_model_config(path))
    load_hf_state_dict(model, tensors)
    del tensors
total = sum(float(p.detach().sum()) for p in model.parameters())  # every page touched: lazily mapped memory counts
peak = hwm_kib()
print(json.dumps({"before_kib": before, "peak_kib": peak, "params": sum(p.numel() for p in model.parameters())}))
"""


def make_checkpoint(out: Path, hidden: int, layers: int, experts: int) -> int:
    import torch  # noqa: PLC0415 (the parent needs torch only here)
    import transformers  # noqa: PLC0415

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench hf_load", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hf-load-") as tmp:
        weight_bytes = make_checkpoint(Path(tmp), args.hidden, args.layers, args.experts)
        # the baseline: a fresh interpreter that has imported torch and snowcat's model package
        rows = {how: run_python(CHILD, tmp, how) for how in ("streaming", "read_all_copy")}
    print(
        f"checkpoint: {weight_bytes / 2**20:.0f} MiB of weights ({args.layers} layers, {args.experts} experts, hidden {args.hidden})"
    )
    for how, r in rows.items():
        r["extra_mib"] = (r["peak_kib"] - r["before_kib"]) / 1024
        r["weight_copies"] = r["extra_mib"] * 2**20 / weight_bytes
        print(f"  {how:14s} peak {r['extra_mib']:8.0f} MiB above start = {r['weight_copies']:.2f} x the weights")
    ratio = rows["read_all_copy"]["extra_mib"] / rows["streaming"]["extra_mib"]
    print(f"  read_all_copy / streaming: {ratio:.2f}")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "what": __doc__.splitlines()[0],
                "shape": vars(args) | {"json": None},
                "weight_mib": weight_bytes / 2**20,
                "rows": rows,
                "ratio_read_all_copy_over_streaming": ratio,
                "peak_unit": "KiB (VmHWM of the loading process)",
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
