"""The wave's whole path as one run (configs/agent-hf.yaml) on the local Slurm cluster: a Hugging
Face Qwen3-MoE checkpoint (small and random, with a tokenizer trained on coding text) staged for
offline use, swe_mini repository tasks played with tools in sandboxes, vLLM sampling the probe, the
RL rollouts and the evaluation, and RL as one heterogeneous job of 2 trainer ranks and 1 vLLM
rollout rank. The RL job gets the notice Slurm sends before the walltime mid-run: it checkpoints,
requeues and finishes; the run equals an uninterrupted local run of the same config bit for bit and
passes `audit`. Real Slurm, MPI, vLLM, sandboxes and tokenizers; nothing is a test double."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from snowcat.pipeline.rundir import DONE, RunDir
from tests.conftest import write_config
from tests.test_rl_preempt import final_sha, logged_step, reference_from, rl_history
from tests.test_slurm import on_local_slurm, wait_status

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "agent-hf.yaml"
CHECKPOINT = "logs/tiny-hf/qwen3_moe_swe"  # where the config expects `snowcat tiny-hf` to have written it
# Shorter episodes than the shipped config (room for tool calls, not for a submission): the test is
# about the pieces composing and surviving, and its two runs share 2 cores.
SMALL = [f"stages.{stage}.max_turns=3" for stage in ("probe", "rl", "eval")]


def test_hf_moe_coding_agent_with_vllm_and_an_rl_hetjob_survives_preemption_and_passes_audit(snowcat, slurm_env, tmp_path):
    model = tmp_path / "qwen3_moe_swe"
    snowcat("tiny-hf", model, "--corpus", "swe_mini", check=True)
    assert CHECKPOINT in CONFIG.read_text()
    text = CONFIG.read_text().replace(CHECKPOINT, str(model))
    cfg = write_config(tmp_path / "agent-hf.yaml", text)
    # the reference needs RL's bits only: the same stages up to it (a stage's seed is the run's seed
    # and its name), without evaluate, export and card
    through_rl, after_rl = text.split("\n  eval:\n")
    assert "\n  rl:\n" in through_rl and "\n  rl:\n" not in after_rl
    reference = write_config(tmp_path / "through-rl.yaml", through_rl + "\n")

    run_dir = tmp_path / "slurm"
    snowcat("run", cfg, *SMALL, *on_local_slurm(run_dir), env=slurm_env, check=True)
    rl_script = next((run_dir / "slurm" / "rl").glob("*_submission.sh")).read_text()
    assert "#SBATCH hetjob" in rl_script and "--het-group=0,1" in rl_script
    # Meanwhile, on the same cores: RL locally, uninterrupted, from the same inputs: the Slurm run's
    # stages before it, copied once done (resume re-hashes them), so that only RL runs twice.
    deadline = time.monotonic() + 900
    while not (run_dir / "stages" / "select" / DONE).is_file():
        assert time.monotonic() < deadline, snowcat.status(run_dir)
        time.sleep(0.5)
    before_rl = ["prestage", "tasks", "sft", "probe", "select"]
    straight = reference_from(run_dir, tmp_path / "straight", reference, [o for o in SMALL if ".eval." not in o], before_rl)
    reference_run = snowcat.popen("resume", straight)
    try:
        history_file = run_dir / "stages" / "rl" / "metrics_history.jsonl"
        while logged_step(history_file) < 1:  # after the first update, before the last (4)
            assert time.monotonic() < deadline, snowcat.status(run_dir)
            time.sleep(0.05)
        job = RunDir.open(run_dir).record("rl")["slurm_job_id"]
        subprocess.run(["scancel", "--signal=USR2", job], env=slurm_env, check=True)
        out, _ = reference_run.communicate(timeout=1200)
    finally:
        reference_run.kill()  # (it has ended unless an assertion above failed)
    assert reference_run.returncode == 0, out[-3000:]
    assert "skipping done stages (outputs verified): prestage, tasks, sft, probe, select" in out, out[-3000:]
    status = wait_status(run_dir, {"done", "failed", "cancelled"}, timeout=900)
    assert {s["status"] for s in status["stages"].values()} == {"done"}, status

    run = RunDir.open(run_dir)
    assert run.record("rl").get("continuations_used", 0) == 1, run.record("rl")  # requeued once, by the notice
    log = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm" / "rl").glob("*.out")))
    assert "checkpoint of step" in log and "saved" in log, log[-3000:]

    # the pieces: the staged checkpoint, its own tokenizer, vLLM rollouts, 2 trainer ranks, tools in sandboxes
    lineage = json.loads((run_dir / "stages" / "sft" / "checkpoints" / "initial" / "meta.json").read_text())["lineage"]
    assert "snowcat/tiny-qwen3-moe-swe" in json.dumps(lineage)
    rl_metrics = json.loads((run_dir / "stages" / "rl" / "metrics.json").read_text())
    assert rl_metrics["trainer_imported_vllm"] is False and rl_metrics["updates"] == 4
    engine = json.loads((run_dir / "stages" / "rl" / "engine_rank2.json").read_text())  # rank 2: the rollout rank
    assert engine["version"] >= 1 and engine["reload_checks"] >= 1
    state = run_dir / "stages" / "rl" / "checkpoints" / "step_000004" / "trainer_state"
    assert sorted(p.name for p in state.glob("rng_rank*.pt")) == ["rng_rank00000.pt", "rng_rank00001.pt"]
    probe = json.loads((run_dir / "stages" / "probe" / "metrics.json").read_text())
    assert probe["infra_failures"] == 0 and probe["tasks"] == 16, probe
    episodes = pq.read_table(run_dir / "stages" / "probe" / "trajectories" / "sft_final.parquet").to_pylist()
    calls = [(name, result) for e in episodes for name, result in zip(e["tool_names"], e["tool_results"]) if name]
    assert len(episodes) == 16 * 2 and {"test", "view"} & {name for name, _ in calls}, calls[:5]
    assert any("Ran" in result or "OK" in result or "FAIL" in result for name, result in calls if name == "test"), calls[:5]

    # a preempted, requeued run is the uninterrupted one
    assert final_sha(run_dir) == final_sha(straight)
    assert rl_history(run_dir) == rl_history(straight)
    assert snowcat("audit", run_dir, env=slurm_env).returncode == 0
