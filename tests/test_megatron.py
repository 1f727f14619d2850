"""trainer.backend megatron (stages/train/megatron): conversion, equivalence across layouts, resume on
another layout, router replay, and the layout checks that run before anything is submitted.

The multi-rank runs are tests/megatron_worker.py's, one process per rank as torchrun starts them (gloo
on the CPU), forked from one worker process that imported megatron-core once for the module
(`_Trainer`), and compare what they wrote. Tolerances: losses to 1e-5 relative (sums of the same terms
in another order); weights after three AdamW steps at lr 1e-2 to 1e-3 absolute: Adam divides by the
gradient's own scale, so a weight whose gradient is at rounding level moves by up to a whole step
whichever way rounding tips it; a real fault (an unreduced gradient) moves weights by ~2e-2.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from snowcat.stages.config import SftConfig
from snowcat.stages.model.config import PRESETS, ModelConfig
from snowcat.stages.model.io import save_model_dir
from snowcat.stages.model.layout import unsupported
from snowcat.stages.model.modeling import MoEForCausalLM
from snowcat.stages.train.megatron import Layout

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "megatron_worker.py"
SMALL = dict(
    vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
    experts_per_token=2, moe_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_dir(path: Path, **changes) -> Path:
    torch.manual_seed(0)
    save_model_dir(path, MoEForCausalLM(ModelConfig(**{**SMALL, **changes})))
    return path


class _Trainer:
    """tests/megatron_worker.py --serve: runs the worker's runs on their ranks (started as torchrun
    would start them: one process per rank, gloo on the CPU), forked from one process that imported
    megatron-core once for the whole module."""

    def __init__(self, log: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT")}
        self.log, self._log = log, log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-W", "ignore", str(WORKER), "--serve"],
            env={**env, "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )  # fmt: skip

    def __call__(self, model: Path, *runs: dict) -> None:
        """Each run (`_run`) of `model`, one after another; fails at the first that fails."""
        for r in runs:
            self.proc.stdin.write(
                json.dumps({"ranks": r["ranks"], "args": [r["args"][0], model, *r["args"][1:]]}, default=str) + "\n"
            )
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            assert reply, f"the worker ended:\n{self.log.read_text()[-3000:]}"
            assert json.loads(reply)["error"] is None, json.loads(reply)["error"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a run still going: its ranks end with it (PDEATHSIG)
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _run(out: Path, tp: int = 1, pp: int = 1, ep: int = 1, *extra) -> dict:
    """One run of the worker: three SFT steps (or `--loss rl`) under TP x PP x EP on as many ranks
    (the data-parallel ranks are the EP ones), writing out/losses.json and out/final."""
    return {"ranks": tp * pp * ep, "args": [out, tp, pp, ep, 3, *extra]}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_training(a: Path, b: Path, key: str = "nll_sum") -> None:
    la, lb = json.loads((a / "losses.json").read_text()), json.loads((b / "losses.json").read_text())
    assert [r["step"] for r in la][-len(lb) :] == [r["step"] for r in lb]
    for ra, rb in zip(la[-len(lb) :], lb, strict=True):
        assert rb[key] == pytest.approx(ra[key], rel=1e-5), (ra, rb)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4), (ra, rb)
        assert rb["tokens"] == ra["tokens"]
    wa, wb = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst < 1e-3, f"weights differ by up to {worst}"


# ---------------------------------------------------------------- before anything runs


def test_layouts_that_cannot_hold_the_model_are_named_by_key():
    cfg = ModelConfig(**SMALL)
    assert list(Layout(2, 1, 2).problems(cfg, 4)) == []
    assert [k for k, _ in Layout(2, 2, 1).problems(cfg, 6)] == ["pipeline_parallel"]  # 2 x 2 does not divide 6
    assert [k for k, _ in Layout(4, 1, 1).problems(cfg, 6)] == ["tensor_parallel"]
    assert [k for k, _ in Layout(1, 1, 3).problems(cfg, 3)] == ["expert_parallel"]  # 4 experts over 3
    assert [k for k, _ in Layout(1, 4, 1).problems(cfg, 4)] == ["pipeline_parallel"]  # 4 stages, 2 layers
    assert [k for k, _ in Layout(1, 1, 2).problems(cfg, 1)] == ["expert_parallel"]  # EP wider than DP
    why = dict(Layout(4, 1, 1).problems(cfg, 4))["tensor_parallel"]
    assert "key/value heads" in why


def test_snowball_layout_holds_the_snowball_shape_on_64_trainer_ranks():
    # the seeds' run: 64 trainer GPUs, TP1/PP2/EP16 (the preset's 376 experts do not split 16 ways;
    # the layout check says so rather than failing on the cluster)
    cfg = PRESETS["snowball-67b-a2b"]
    assert [k for k, _ in Layout(1, 2, 16).problems(cfg, 64)] == ["expert_parallel"]
    assert list(Layout(1, 2, 8).problems(cfg, 64)) == []


def test_architectures_without_a_conversion_are_refused():
    assert unsupported(ModelConfig(**SMALL)) is None
    assert unsupported(ModelConfig(**{**SMALL, "shared_expert_intermediate_size": 16})) is None
    assert "olmoe" in unsupported(ModelConfig(**{**SMALL, "qk_norm": "full", "head_dim": 16}))
    dense = {**SMALL, "mlp_only_layers": [0], "dense_intermediate_size": 32}
    assert "mlp_only_layers" in unsupported(ModelConfig(**dense))


def test_config_refuses_tensor_and_pipeline_parallel_without_megatron():
    assert [k for k, _ in SftConfig(tensor_parallel=2).parallelism_problems()] == ["tensor_parallel"]
    assert [k for k, _ in SftConfig(pipeline_parallel=2, backend="fsdp").parallelism_problems()] == ["pipeline_parallel"]
    assert list(SftConfig(tensor_parallel=2, pipeline_parallel=2, backend="megatron").parallelism_problems()) == []
    recompute = SftConfig(backend="megatron", activation_checkpointing=True)
    assert [k for k, _ in recompute.parallelism_problems()] == ["activation_checkpointing"]


def test_a_bad_layout_is_refused_before_megatron_builds_anything(tmp_path):
    model = _model_dir(tmp_path / "m")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "RANK": "0", "WORLD_SIZE": "1"}
    r = subprocess.run(
        [sys.executable, "-W", "ignore", str(WORKER), str(tmp_path / "o"), str(model), "2", "1", "1", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    assert "trainer.tensor_parallel: tensor_parallel x pipeline_parallel = 2 x 1 does not divide the 1 trainer ranks" in r.stderr
    assert not (tmp_path / "o" / "final").exists()


# ---------------------------------------------------------------- conversion


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [{"tie_word_embeddings": True}, {"shared_expert_intermediate_size": 24}],
    ids=["tied", "shared-expert"],
)
def test_converted_model_matches_transformers_and_ours_and_converts_back_exactly(tmp_path, changes):
    """A shared expert (test-micro has one; Qwen2-MoE's form) is built in megatron's GPTModel and
    converted both ways; transformers has no one architecture with it and Qwen3's attention, so its
    reference is Qwen3-MoE with Qwen2-MoE's MoE blocks (tests/megatron_conversion.py)."""
    model = _model_dir(tmp_path / "m", **changes)
    out = tmp_path / "conversion.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "RANK": "0", "WORLD_SIZE": "1"}
    r = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests" / "megatron_conversion.py"), str(model), str(out)],
                       env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["logprob_vs_transformers"] < 1e-5
    assert got["logprob_vs_ours"] < 1e-5 and got["entropy_vs_ours"] < 1e-5
    assert got["routes_agree"] == 1.0
    assert got["round_trip_names_equal"] and got["round_trip_exact"]
    # router replay: the recorded experts are the ones used, in both implementations alike
    assert got["replay_vs_ours"] < 1e-5 and got["replay_changes_logprobs"] > 1e-3
    assert got["replay_own_choices_agree"]
    if changes.get("shared_expert_intermediate_size"):  # there, and large enough to be seen
        assert got["shared_experts"] == SMALL["num_layers"] and got["shared_expert_changes_logprobs"] > 1e-3


# ---------------------------------------------------------------- layouts


# one xdist worker runs the tests that share the baselines and the worker process (`runs`), once
LAYOUTS = pytest.mark.xdist_group("megatron_layouts")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process baselines (SFT loss, RL loss with router replay), and their model: with a
    shared expert (split over tensor-parallel ranks as a dense MLP is, its gate replicated), and
    without router losses: megatron's are means over each rank's tokens (a data-parallel
    replica's, a sequence-parallel slice's), so they differ by layout where a rank's token count does."""
    root = tmp_path_factory.mktemp("megatron")
    model = _model_dir(root / "model", shared_expert_intermediate_size=24, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    train = _Trainer(root / "worker.log")
    try:
        train(model, _run(root / "base"), _run(root / "base-rl", 1, 1, 1, "--loss", "rl"))
        yield root, model, train
    finally:
        train.close()


def _trains_and_resumes(runs, name: str, layout: tuple, resumed: str, resumed_layout: tuple) -> None:
    """Three SFT steps under `layout` (TP, PP, EP) equal the one-process run, and its checkpoint
    after step 1 resumed under `resumed_layout` continues as the uninterrupted run."""
    root, model, train = runs
    train(
        model,
        _run(root / name, *layout, "--save-at", 1),
        _run(root / resumed, *resumed_layout, "--from", root / name / "ckpt"),
    )
    _same_training(root / "base", root / name)
    _same_training(root / "base", root / resumed)


@pytest.mark.slow
@LAYOUTS
def test_tensor_parallel_trains_as_one_process_and_resumes_on_another_layout(runs):
    """TP2 against one process; its checkpoint after step 1 resumed on one rank equals the
    uninterrupted run. (Resumed on its own layout, bit for bit: tests/test_rl_preempt.py, on the
    local cluster.)"""
    _trains_and_resumes(runs, "tp2", (2, 1, 1), "resumed-tp1", (1, 1, 1))


@pytest.mark.slow
@LAYOUTS
def test_expert_parallel_over_data_parallel_ranks_trains_as_one_process_and_resumes_on_one_rank(runs):
    """EP2 over two data-parallel ranks: each holds half the experts and its own rows; tokens cross
    ranks in the all-to-all both ways. Its checkpoint after step 1 (each rank wrote the moments of
    its own experts) resumes on one rank holding all of them, as the uninterrupted run."""
    _trains_and_resumes(runs, "ep2", (1, 1, 2), "resumed-ep1", (1, 1, 1))


@pytest.mark.slow
@LAYOUTS
def test_pipeline_parallel_trains_as_one_process_and_resumes_on_one_rank(runs):
    """PP2: each rank holds one layer (1F1B over the two micro-batches); its checkpoint after step 1
    (each stage wrote its own layer's moments, under the layer's global number) resumes on one
    rank holding both layers, as the uninterrupted run."""
    _trains_and_resumes(runs, "pp2", (1, 2, 1), "resumed-pp1", (1, 1, 1))


@pytest.mark.slow
@LAYOUTS
def test_tensor_and_expert_parallel_over_four_ranks_train_as_one_process_and_resume_on_two(runs):
    """TP2 x EP2 over four ranks (two data-parallel replicas of a sequence-parallel pair, the
    experts split over the replicas); its checkpoint after step 1 resumes on two ranks under
    another layout altogether (PP2), as the uninterrupted run."""
    _trains_and_resumes(runs, "tp2ep2", (2, 1, 2), "resumed-pp2", (1, 2, 1))


@pytest.mark.slow
@LAYOUTS
def test_tensor_and_pipeline_parallel_over_four_ranks_train_as_one_process_and_resume_on_two(runs):
    """TP2 x PP2 over four ranks (one replica: each stage a sequence-parallel pair, activations
    crossing stages as sequence slices); its checkpoint after step 1 (each rank wrote its slice of
    its stage's layer) resumes on two ranks that split the model another way (EP2: whole layers,
    half the experts each), as the uninterrupted run."""
    _trains_and_resumes(runs, "tp2pp2", (2, 2, 1), "resumed-ep2", (1, 1, 2))


@pytest.mark.slow
@LAYOUTS
def test_expert_and_pipeline_parallel_over_four_ranks_train_as_one_process_and_resume_on_two(runs):
    """EP2 x PP2 over four ranks (two data-parallel replicas of a two-stage pipeline, each stage's
    experts split over the replicas: the all-to-all runs within a stage); its checkpoint after
    step 1 (each rank wrote half of one layer's experts) resumes on two ranks under TP2, as the
    uninterrupted run."""
    _trains_and_resumes(runs, "ep2pp2", (1, 2, 2), "resumed-tp2", (2, 1, 1))


@pytest.mark.slow
@LAYOUTS
def test_tensor_pipeline_and_expert_parallel_over_eight_ranks_train_as_one_process_and_resume_on_one(runs):
    """TP2 x PP2 x EP2 over eight ranks, the three at once as a large MoE is laid out (two replicas
    of a two-stage pipeline of sequence-parallel pairs, the experts split over the replicas); its
    checkpoint after step 1 resumes on one rank holding every slice, as the uninterrupted run."""
    _trains_and_resumes(runs, "tp2pp2ep2", (2, 2, 2), "resumed-one", (1, 1, 1))


@pytest.mark.slow
@LAYOUTS
def test_rl_loss_with_router_replay_under_each_layout_trains_as_one_process(runs):
    """RL's TIS policy loss with the rollout's expert choices replayed, under TP2, PP2, EP2 (the
    replayed choices then pick experts another rank holds) and the three at once over eight ranks."""
    root, model, train = runs
    layouts = {"rl-tp2": (2, 1, 1), "rl-pp2": (1, 2, 1), "rl-ep2": (1, 1, 2), "rl-tp2pp2ep2": (2, 2, 2)}
    train(model, *(_run(root / name, *layout, "--loss", "rl") for name, layout in layouts.items()))
    for name in layouts:
        _same_training(root / "base-rl", root / name, key="loss/loss")


# ---------------------------------------------------------------- on a real site's rules

SNOWBALL = REPO / "configs" / "snowball-megatron.yaml"
VISTA_NODES = (  # one GH200 per Vista node: the same 64 + 48 GPUs as 64 + 48 nodes
    "stages.rl.resources.components.trainer.nodes=64",
    "stages.rl.resources.components.trainer.tasks_per_node=1",
    "stages.rl.resources.components.rollout.nodes=48",
    "stages.rl.resources.components.rollout.tasks_per_node=1",
)


def _rendered(stdout: str) -> Path:
    return Path(re.search(r"are in (\S+?);", " ".join(stdout.split())).group(1))


@pytest.mark.parametrize(
    ("site", "extra", "trainer", "rollout"),
    [("jsc-jupiter", (), (16, 4), (12, 4)), ("tacc-vista", VISTA_NODES, (64, 1), (48, 1))],
)
def test_the_snowball_layout_dry_runs_to_a_hetjob_of_64_trainer_and_48_inference_gpus(snowcat, site, extra, trainer, rollout):
    proc = snowcat(
        "run", SNOWBALL, "--executor", "slurm", "--site", site, "--dry-run", "--skip-plan", "site.account=proj", *extra
    )
    assert proc.returncode == 0, proc.stderr
    script = (_rendered(proc.stdout) / "rl.sbatch").read_text()
    trainer_part, rollout_part = script.split("#SBATCH hetjob")[:2]
    for part, (nodes, per_node) in ((trainer_part, trainer), (rollout_part, rollout)):
        assert f"--nodes={nodes}\n" in part and f"--ntasks-per-node={per_node}\n" in part
    assert nodes * per_node == 48 and trainer[0] * trainer[1] == 64
    assert "--het-group=0,1" in script  # one MPI world over both components


def test_a_snowball_layout_that_does_not_divide_its_trainer_ranks_is_refused_before_submission(snowcat):
    proc = snowcat("run", SNOWBALL, "--executor", "slurm", "--site", "jsc-jupiter", "--dry-run", "site.account=proj",
                   "stages.rl.resources.components.trainer.nodes=12")  # fmt: skip
    assert proc.returncode == 2
    assert "stages.rl.expert_parallel: 16 does not divide the 24 data-parallel ranks" in proc.stderr


def test_a_preset_with_a_shared_expert_is_accepted_and_its_layout_checked_at_load(snowcat, tmp_path):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        "name: m\nstages:\n  tasks: {kind: tasks, domains: {arith: {count: 40, val_count: 4, difficulties: [2]}}}\n"
        "  sft: {kind: sft, needs: [tasks], model: test-micro, backend: megatron}\n"
    )
    assert snowcat("run", cfg, "--dry-run").returncode == 0  # test-micro: a shared expert
    proc = snowcat("run", cfg, "--dry-run", "stages.sft.expert_parallel=3", "stages.sft.resources.tasks_per_node=3")
    assert proc.returncode == 2
    assert "stages.sft.expert_parallel: 3 does not divide the model's 4 experts" in proc.stderr
