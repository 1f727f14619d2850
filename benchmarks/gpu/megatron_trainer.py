"""One H200: step time and peak GPU memory of the megatron backend against the torch backend on the
same MoE (`snowball-mini`, bf16 autocast over float32 masters), side by side in one run.

    python benchmarks/gpu/megatron_trainer.py [--steps 6] [--rows 4] [--seq 2048] [--json FILE]

Prepared for the device machine (one GPU, under 5 minutes with the defaults); UNVERIFIED until a
GPU run says otherwise: nothing here has run on a GPU. Each backend runs in a fresh process (one
rank, a process group of one), takes `--steps` optimizer steps of the shared SFT loss on random
tokens and reports the median step time after the first (warm-up) and torch's peak allocated
memory. Whether Transformer Engine is present is reported: without it megatron takes its local
layers, as on a CPU (docs/megatron.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
import torch
from snowcat.stages.train import OptimConfig, load_for_training
from snowcat.stages.train.loss import sft_loss
from snowcat.stages.train.precision import Precision

spec = json.loads(sys.argv[1])
torch.cuda.set_device(0)
precision = Precision(torch.float32, torch.bfloat16, torch.bfloat16)
backend, _ = load_for_training(spec["model_dir"], spec["backend"], OptimConfig(lr=1e-4, warmup_steps=0, total_steps=100),
                               device=torch.device("cuda", 0), precision=precision, verify=False)
g = torch.Generator().manual_seed(0)
rows, seq, vocab = spec["rows"], spec["seq"], backend.model.config.vocab_size
times = []
torch.cuda.reset_peak_memory_stats()
for _ in range(spec["steps"]):
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": torch.zeros(rows, seq, dtype=torch.long)}
    torch.cuda.synchronize(); t0 = time.perf_counter()
    backend.train_step([batch], sft_loss)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
print(json.dumps({"step_s": times, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend: str, model_dir: Path, args) -> dict:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    spec = {"backend": backend, "model_dir": str(model_dir), "steps": args.steps, "rows": args.rows, "seq": args.seq}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["median_step_s"] = statistics.median(res["step_s"][1:]) if len(res["step_s"]) > 1 else res["step_s"][0]
    return res


def main(argv: list[str] | None = None) -> int:
    import torch  # noqa: PLC0415 (the parent needs torch only to write the model)

    from snowcat.stages.model import PRESETS, MoEForCausalLM, save_model_dir  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        import transformer_engine  # noqa: F401, PLC0415

        te = True
    except ImportError:
        te = False
    with tempfile.TemporaryDirectory(prefix="snowcat-gpu-bench-") as tmp:
        torch.manual_seed(0)
        save_model_dir(Path(tmp) / "model", MoEForCausalLM(PRESETS["snowball-mini"]))
        results = {name: run(name, Path(tmp) / "model", args) for name in ("torch", "megatron")}
    report = {
        "benchmark": "gpu/megatron_trainer",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transformer_engine": te,
        "model": "snowball-mini",
        "step": {"rows": args.rows, "seq": args.seq, "steps": args.steps},
        "results": results,
    }
    for name, res in results.items():
        if "error" in res:
            print(f"{name}: failed\n{res['error']}")
        else:
            print(f"{name:<9} median step {res['median_step_s']:.3f} s   peak {res['peak_gib']:.1f} GiB")
    if all("error" not in r for r in results.values()):
        print(f"megatron / torch: step time {results['megatron']['median_step_s'] / results['torch']['median_step_s']:.2f}x,"
              f" peak memory {results['megatron']['peak_gib'] / results['torch']['peak_gib']:.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
