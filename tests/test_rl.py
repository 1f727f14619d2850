"""RL stage end to end on a tiny random model: outputs, MPI == single process, SIGKILL/preemption resume
is bit-identical, and the trainer scores tokens under the engine's own sampling distribution."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import snowcat.stages.rl as rl
import snowcat.stages.tasks as tasks_stage
from snowcat.pipeline.config import stage_config
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import checkpoint_dir, sha256_file
from snowcat.pipeline.history import History
from snowcat.stages.agent import Budget, EpisodeJob, SingleTurnEnv, run_episodes
from snowcat.stages.model import PRESETS, MoEForCausalLM, load_model_dir, save_model_dir
from snowcat.stages.rlcore.objective import make_batch, sampled_logprobs
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.sft import tokenizer_corpus
from snowcat.stages.taskgen import generate_domain, load_tasks, save_tasks, split_tasks
from snowcat.stages.tokenizer import train_tokenizer
from tests.conftest import mpirun
from tests.rl_stage import SMALL, make_ctx, parity_verify

REPO = Path(__file__).resolve().parent.parent


def build_inputs(root: Path, seed: int = 3) -> None:
    """tasks/ (train, val) and sft/checkpoints/final: a random test-micro model with a trained tokenizer."""

    rng = np.random.default_rng(seed)
    train, val = [], []
    for dom, diffs in (("closure", [1, 2]), ("arith", [2])):
        a, b = split_tasks(generate_domain(rng, dom, diffs, 120), 20, rng)
        train, val = train + a, val + b
    save_tasks(root / "tasks", "train", train)
    save_tasks(root / "tasks", "val", val)
    tok = train_tokenizer(tokenizer_corpus(train), 300)
    cfg = PRESETS["test-micro"]
    torch.manual_seed(seed)
    model = MoEForCausalLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": tok.vocab_size}))
    save_model_dir(root / "sft" / "checkpoints" / "final", model, tok)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl_inputs")
    build_inputs(root)
    return root


def final_sha(run_dir: Path) -> str:
    return sha256_file(run_dir / "rl" / "checkpoints" / "final" / "model.safetensors")


def trained_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    keep = (
        "step",
        "reward/mean",
        "loss/pg_loss",
        "grad_norm",
        "mismatch/mean_abs_dlogp",
        "staleness/mean_abs_dlogp",
        "val/pass@1",
    )
    return [{k: r[k] for k in keep if k in r} for r in rows]


@pytest.fixture(scope="module")
def baseline(inputs, tmp_path_factory) -> Path:
    """One uninterrupted single-process run (the reference for every other layout and for resume)."""
    run_dir = tmp_path_factory.mktemp("rl_baseline")
    rl.run(make_ctx(inputs, run_dir))
    return run_dir


def test_run_writes_loadable_checkpoints_and_metrics(baseline):
    out = baseline / "rl"
    for name in ("initial", "final", "best"):
        model, _, tok = load_model_dir(checkpoint_dir(out, name))
        assert tok is not None
    assert (out / "checkpoints" / "best").read_text().strip().startswith("step_")
    rows = [json.loads(line) for line in (out / "metrics_history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(0, 7))  # row 0: the init's held-out score
    assert "val/pass@1" in rows[0]
    rows = rows[1:]
    for key in (
        "reward/mean",
        "pass_rate",
        "entropy",
        "length/response_mean",
        "turns/mean",
        "status/ok",
        "mismatch/mean_abs_dlogp",
        "mismatch/ratio_p50",
        "throughput/sampled_tokens_per_s",
        "policy_lag/mean",
    ):
        assert all(key in r for r in rows), key
    assert all(r["policy_lag/mean"] == (0 if r["step"] == 1 else 1) for r in rows)  # batch k from step k-1
    assert {r["step"] for r in rows if "val/pass@1" in r} == {3, 6}
    assert any(r["loss/pg_loss"] != 0 for r in rows)  # the test reward gives real advantages
    # engine vs trainer under the same (behaviour) weights, both fp32 on CPU: agree to rounding;
    # the weights did move between versions, which the staleness metric sees
    assert all(r["mismatch/max_abs_dlogp"] < 1e-3 for r in rows)
    assert any(r["staleness/mean_abs_dlogp"] > 0 for r in rows[1:])
    h = History(baseline).read("rl")
    assert list(h["step"]) == list(range(0, 7))
    assert np.allclose(h["reward/mean"][1:], [r["reward/mean"] for r in rows])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["updates"] == 6 and "val/pass@1" in metrics


def mpirun_child(script: Path, inputs: Path, run_dir: Path, kill: dict) -> subprocess.CompletedProcess:
    """The child script as 1 trainer + 1 rollout rank under mpirun (`kill`: where a rank dies)."""
    return mpirun(2, script, inputs, run_dir, json.dumps(kill), timeout=600)


@pytest.mark.slow
def test_mpi_one_trainer_one_rollout_matches_single_process(inputs, baseline, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("needs OpenMPI's mpirun")
    proc = mpirun_child(_child_script(tmp_path), inputs, tmp_path, {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '"role": "rollout"' in proc.stdout
    assert not list((tmp_path / "rl" / "queue").glob("batch_*"))  # trajectories went over MPI, not files
    assert final_sha(tmp_path) == final_sha(baseline)
    assert trained_rows(tmp_path) == trained_rows(baseline)


_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    sys.path.insert(0, os.environ["PYTHONPATH"])
    import snowcat.stages.rlcore.handoff as handoff
    from tests.rl_stage import make_ctx
    import snowcat.stages.rl as rl
    inputs, run_dir, kill = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    rank, world = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    real_manifest, real_write = handoff.write_manifest, handoff.atomic_write_text
    def manifest(path, *a, **kw):  # killed inside the temp dir of a weight version, its files written
        if path.parent.name == "weights" and path.name.startswith(f".step_{kill.get('building', -1):06d}."):
            die()
        return real_manifest(path, *a, **kw)
    def write(path, text):  # killed after the rename, before STABLE
        if path.name == "STABLE" and path.parent.name == f"step_{kill.get('before_stable', -1):06d}":
            die()
        return real_write(path, text)
    # handoff publishes the weight versions with the names it imported
    handoff.write_manifest = manifest
    handoff.atomic_write_text = write
    print(json.dumps(rl.run(make_ctx(inputs, run_dir, rank=rank, world=world))), flush=True)
""")


def _child_script(tmp_path: Path) -> Path:
    path = tmp_path / "rl_child.py"
    path.write_text(_CHILD)
    return path


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_is_bit_identical(inputs, baseline, tmp_path):
    run_dir = tmp_path / "run"
    script = _child_script(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def child(kill: dict, after_s: float | None = None) -> int:
        p = subprocess.Popen(
            [sys.executable, str(script), str(inputs), str(run_dir), json.dumps(kill)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if after_s is not None:
            try:
                p.wait(timeout=after_s)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        p.wait(timeout=600)
        return p.returncode

    # killed while publishing weights: inside the version's temp dir, then between rename and STABLE
    assert child({"building": 3}) == -signal.SIGKILL
    assert not (run_dir / "rl" / "weights" / "step_000003" / "STABLE").exists()
    assert child({"before_stable": 5}) == -signal.SIGKILL
    # then at random instants (seeded, so a failure can be replayed), until a run gets to the end
    rng = random.Random(20261129)
    codes = [child({}, after_s=rng.uniform(2.0, 12.0)) for _ in range(2)]
    while child({}) != 0:
        codes.append("retry")
        assert len(codes) < 6
    assert final_sha(run_dir) == final_sha(baseline)
    assert trained_rows(run_dir) == trained_rows(baseline)
    weights = sorted(p.name for p in (run_dir / "rl" / "weights").iterdir())
    assert all(not n.startswith(".") for n in weights)  # no torn temp dirs survive
    assert "step_000000" not in weights  # versions no batch can need any more are pruned


@pytest.mark.slow
def test_mpi_trainer_killed_while_publishing_then_resumed_is_bit_identical(inputs, baseline, tmp_path):
    """Under mpirun the trainer dies inside a weight publish (mpirun then ends the rollout rank);
    a new mpirun resumes both roles from the checkpoint and ends with the same weights."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs OpenMPI's mpirun")
    script = _child_script(tmp_path)
    assert mpirun_child(script, inputs, tmp_path / "run", {"building": 4}).returncode != 0
    assert not (tmp_path / "run" / "rl" / "checkpoints" / "final").exists()
    proc = mpirun_child(script, inputs, tmp_path / "run", {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert final_sha(tmp_path / "run") == final_sha(baseline)
    assert trained_rows(tmp_path / "run") == trained_rows(baseline)


class _PreemptAt(StageContext):
    """A context whose scheduler 'announces the end of the job' on the n-th poll."""

    polls = 0
    at = 4

    def checkpoint_due(self) -> bool:
        type(self).polls += 1
        return type(self).polls == self.at


def test_preemption_checkpoints_then_resume_is_bit_identical(inputs, baseline, tmp_path):
    pre = make_ctx(inputs, tmp_path, cls=_PreemptAt)
    with pytest.raises(StageContext.Preempted):
        rl.run(pre)
    assert (tmp_path / "rl" / "checkpoints" / "step_000003").is_dir()
    rl.run(make_ctx(inputs, tmp_path))
    assert final_sha(tmp_path) == final_sha(baseline)


def test_trainer_logprobs_use_the_engines_truncated_distribution(inputs):
    """top-k/top-p sampling at temperature 0.7: the trainer's recomputation under the same support
    matches the engine's processed logprobs; a full-vocabulary recomputation would not."""

    model, _, tok = load_model_dir(inputs / "sft" / "checkpoints" / "final")
    tasks = load_tasks(inputs / "tasks", "train")[:4]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=8, stop_ids=(tok.end_of_turn_id,))
    jobs = [EpisodeJob(t, g, a) for g, t in enumerate(tasks) for a in range(3)]
    trajs = run_episodes(
        TorchEngine(model), tok, jobs, SingleTurnEnv(tok), params, Budget(128, 8, 1), 9, 0, verifier=parity_verify
    )
    batch = make_batch(trajs, tok.pad_id, "rloo_n")
    mask = batch["mask"] > 0
    with torch.no_grad():
        same, _, _ = sampled_logprobs(model, batch, params)
        full, _, _ = sampled_logprobs(model, batch, SamplingParams(temperature=0.7, max_tokens=8))
    gap_same = (same - batch["rollout_logprobs"])[mask].abs()
    gap_full = (full - batch["rollout_logprobs"])[mask].abs()
    assert mask.sum() > 20
    assert gap_same.max() < 1e-4
    assert gap_full.mean() > 1e-2  # log(kept mass): what ignoring the truncation would cost
    # A sampled token outside the trainer's own support (bf16 vs fp32 logits move boundaries; here
    # forced with top_k=1) keeps a finite logprob: a mismatch for TIS, never -inf / NaN.
    with torch.no_grad():
        narrow, _, _ = sampled_logprobs(model, batch, SamplingParams(temperature=0.7, top_k=1, max_tokens=8))
    assert torch.isfinite(narrow[mask]).all() and (narrow[mask] < -1e-3).any()


def test_training_tasks_come_from_the_select_band_when_given(inputs, tmp_path):
    train = load_tasks(inputs / "tasks", "train")
    band = [t for t in train if t.domain == "closure"][:10]
    save_tasks(tmp_path / "select", "band", band)
    ctx = make_ctx(inputs, tmp_path)
    pool, held_out = rl.load_pool(ctx, ctx.config)
    assert [t.task_id for t in pool] == [t.task_id for t in train]  # no band: the train split
    ctx.inputs["select"] = tmp_path / "select"
    pool, held_out = rl.load_pool(ctx, ctx.config)
    assert [t.task_id for t in pool] == [t.task_id for t in band]
    assert held_out and {t.domain for t in held_out} == {"closure"}  # eval follows the trained domains
    batches = [rl.batch_tasks(pool, 4, 5, k) for k in range(5)]
    assert all(len(b) == 4 for b in batches)
    assert {t.task_id for b in batches[:2] for t in b} <= {t.task_id for t in band}
    assert batches == [rl.batch_tasks(pool, 4, 5, k) for k in range(5)]  # a pure function of (seed, k)


def test_bad_config_names_the_key(inputs, tmp_path):
    with pytest.raises(UserError, match=r"^stages\.rl\.estimator: Invalid value 'ppo', expected one of"):
        rl.run(make_ctx(inputs, tmp_path, estimator="ppo"))
    with pytest.raises(UserError, match=r"^stages\.rl\.attempts: rloo_n needs at least 2 attempts per task"):
        rl.run(make_ctx(inputs, tmp_path, attempts=1))
    with pytest.raises(
        UserError, match=r"^stages\.rl\.attempts: grpo needs at least 2 attempts per task \(one attempt has no baseline\)"
    ):
        rl.run(make_ctx(inputs, tmp_path, attempts=1, estimator="grpo"))
    with pytest.raises(UserError, match=r"rl.tasks_per_update=999 exceeds"):
        rl.run(make_ctx(inputs, tmp_path, tasks_per_update=999))
    with pytest.raises(UserError, match=r"^stages\.rl\.init_from: 'nope:final' names stage 'nope', which is not in needs"):
        rl.run(make_ctx(inputs, tmp_path, init_from="nope:final"))


def test_a_dev_split_is_held_out_of_train_and_val_and_leaves_val_as_it_was(tmp_path):
    domains = {"closure": {"count": 60, "val_count": 10, "difficulties": [1, 2]}}
    plain = StageContext.standalone("tasks", {"domains": domains}, run_dir=tmp_path / "plain", seed=4)
    tasks_stage.run(plain)
    domains["closure"]["dev_count"] = 12
    ctx = StageContext.standalone("tasks", {"domains": domains}, run_dir=tmp_path / "dev", seed=4)
    metrics = tasks_stage.run(ctx)
    train, dev, val = (load_tasks(ctx.out_dir, s) for s in ("train", "dev", "val"))
    assert metrics["dev"] == len(dev) == 12 and len(train) == 38 and len(val) == 10
    assert not {t.task_id for t in dev} & ({t.task_id for t in train} | {t.task_id for t in val})
    assert val == load_tasks(plain.out_dir, "val")  # asking for dev never changes the held-out score's tasks
    assert not (plain.out_dir / "dev.parquet").exists()
    with pytest.raises(UserError, match=r"domains\.closure\.dev_count: val_count \+ dev_count must be less than count"):
        StageContext.standalone(
            "tasks", {"domains": {"closure": {"count": 20, "val_count": 10, "dev_count": 10}}}, run_dir=tmp_path
        )


def test_with_a_dev_split_rl_selects_checkpoints_on_it_not_on_val(inputs, tmp_path):
    with_dev = tmp_path / "inputs"
    shutil.copytree(inputs, with_dev)
    val = load_tasks(with_dev / "tasks", "val")
    save_tasks(with_dev / "tasks", "dev", val[::2])  # a split of its own, disjoint from what val keeps
    save_tasks(with_dev / "tasks", "val", val[1::2])
    ctx = make_ctx(with_dev, tmp_path / "run", updates=3, eval_every=3)
    _, held_out = rl.load_pool(ctx, ctx.config)
    assert {t.task_id for t in held_out} <= {t.task_id for t in val[::2]}
    metrics = rl.run(ctx)
    ledger = json.loads((tmp_path / "run" / "rl" / "checkpoints" / "retention.json").read_text())
    assert ledger["policy"]["metric"] == "dev/pass@1"
    assert "dev/pass@1" in metrics and "val/pass@1" not in metrics and metrics["dev/tasks"] == len(held_out)


def test_pinned_updates_outlive_retention(inputs, tmp_path):
    """rl.pin_steps: a pinned checkpoint is kept whatever retention drops; an unpinned one like it is
    not (updates 2 and 4 are saved with no metric, neither last nor best)."""
    ctx = make_ctx(inputs, tmp_path / "run", updates=6, pin_steps=[2])
    rl.run(ctx)
    ckpts = tmp_path / "run" / "rl" / "checkpoints"
    ledger = json.loads((ckpts / "retention.json").read_text())
    assert ledger["policy"]["pinned"] == [2] and (ckpts / "step_000002").is_dir()
    assert 4 in {d["step"] for d in ledger["deleted"]} and not (ckpts / "step_000004").exists()
    assert 2 not in {d["step"] for d in ledger["deleted"]}


@pytest.mark.parametrize("pin", [5, 7, 0])
def test_a_pinned_update_that_is_never_saved_is_refused(pin):
    with pytest.raises(UserError, match=rf"pin_steps: update {pin} is never saved"):
        stage_config("rl", {**SMALL, "pin_steps": [pin]})


def test_each_update_records_how_many_trajectories_of_each_domain_entered_the_loss(baseline):
    rows = [json.loads(line) for line in (baseline / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    per_update = SMALL["tasks_per_update"] * SMALL["attempts"]
    updates = [r for r in rows if "reward/mean" in r]  # rows of an update (the step-0 row holds only an eval)
    assert len(updates) == SMALL["updates"]
    for row in updates:
        exposure = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("exposure/")}
        assert set(exposure) <= {"closure", "arith"} and 0 < sum(exposure.values()) <= per_update
        assert all(f"reward/{d}" in row for d, n in exposure.items() if n)  # a domain in the loss has its reward
