"""The prepared GPU acceptance run (benchmarks/gpu/run.sh): what a CPU can check of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "benchmarks" / "gpu" / "run.sh"
SECTIONS = {"kernel", "vllm_logprobs", "reload", "router_replay"}


def run_sh(*args: str, cwd) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHON": sys.executable}
    return subprocess.run([str(RUN_SH), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_dry_run_from_elsewhere_writes_every_section_in_the_schema(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_sh("--dry-run", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu-acceptance" and result["dry_run"] is True and result["schema"] == 1
    assert len(result["commit"]) == 40 and set(result["load_average_1min"]) == {"before", "after"}
    assert result["machine"]["gpu"] is None and result["machine"]["versions"]["torch"]
    assert set(result["sections"]) == SECTIONS
    assert all(s["status"] == "dry_run" for s in result["sections"].values())
    assert result["sections"]["kernel"]["shape"] == {"n": 32768, "h": 2048, "v": 128256, "dtype": "bf16"}
    assert result["sections"]["router_replay"]["needs"] == ["vllm"]
    verdict = "kernel: dry_run; vllm_logprobs: dry_run; reload: dry_run; router_replay: dry_run"
    assert proc.stdout.strip().splitlines()[-1] == verdict


def test_without_a_gpu_the_real_run_refuses_in_one_line(tmp_path):
    proc = run_sh("--json", str(tmp_path / "gpu.json"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "no CUDA device: this run needs one GPU (use --dry-run on a CPU)"
    assert not (tmp_path / "gpu.json").exists()


def test_an_unknown_section_is_named(tmp_path):
    proc = run_sh("--dry-run", "--only", "kernel,warp", cwd=tmp_path)
    assert proc.returncode == 2 and "--only: unknown section(s) warp" in proc.stderr
