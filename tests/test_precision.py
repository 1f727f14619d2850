"""Precision as users meet it: a Hugging Face checkpoint stored in bf16 (as nearly every hub model
is) trains with float32 master weights and moments, exactly as the same checkpoint converted to
float32 does; bf16 masters, asked for, barely move at RL's learning rate; a resumed run is the
uninterrupted one; the export of a model trained from bf16 passes the equivalence check comparing
like with like; bad precision settings are refused naming the key."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import snowcat.stages.sft as sft
from snowcat.pipeline.config import stage_config
from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import sha256_file
from snowcat.stages import export, rl
from snowcat.stages.model.io import load_model_config
from snowcat.stages.model.tiny_hf import tiny_checkpoint
from snowcat.stages.train import precision
from snowcat.stages.train.precision import stored_dtype, unchanged_fraction
from tests.test_hf_models import small_task_set
from tests.test_sft import Ctx  # a StageContext whose scheduler announces the job's end on a given poll

pytestmark = pytest.mark.slow  # SFT and RL runs, three backends: about two minutes

RL_LR = 5e-7  # the seeds' RL learning rate


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Tasks, a tiny Qwen3-MoE saved by transformers in bf16, and the same values stored in fp32."""
    root = tmp_path_factory.mktemp("precision")
    tiny_checkpoint(root / "bf16", small_task_set(root / "tasks"), dtype="bfloat16")
    shutil.copytree(root / "bf16", root / "fp32")
    save_file(
        {k: v.float() for k, v in load_file(root / "bf16" / "model.safetensors").items()}, root / "fp32" / "model.safetensors"
    )
    config = json.loads((root / "fp32" / "config.json").read_text())
    (root / "fp32" / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    assert stored_dtype(root / "bf16") == torch.bfloat16 and stored_dtype(root / "fp32") == torch.float32
    return root


def sft_ctx(hub, source: str, out, preempt_before=None, **overrides) -> Ctx:
    values = dict(model=f"hf:{hub / source}", steps=12, save_every=6, seq_len=96, batch_rows=4, warmup_steps=0, lr=RL_LR)
    ctx = Ctx.standalone(
        "sft", values | {"eval_tasks": 0, "threads": 1, **overrides}, run_dir=out, inputs={"tasks": hub / "tasks"}, seed=3
    )
    ctx.preempt_before = preempt_before
    return ctx


def history(ctx) -> list[dict]:
    return [json.loads(line) for line in (ctx.out_dir / "metrics_history.jsonl").read_text().splitlines()]


def weights(ctx, name: str = "final") -> dict[str, torch.Tensor]:
    return load_file(ctx.out_dir / "checkpoints" / name / "model.safetensors")


@pytest.fixture(scope="module")
def sft_runs(hub, tmp_path_factory):
    """SFT at RL's learning rate from the bf16 and the fp32 copy (fp32 masters by default), and from
    the bf16 copy with bf16 masters asked for."""
    out = tmp_path_factory.mktemp("sft")
    runs = {
        name: sft_ctx(hub, source, out / name, **extra)
        for name, source, extra in [
            ("bf16", "bf16", {}),
            ("fp32", "fp32", {}),
            ("bf16-masters", "bf16", {"master_dtype": "bfloat16"}),
        ]
    }
    metrics = {name: sft.run(ctx) for name, ctx in runs.items()}
    return runs, metrics


def test_a_bf16_checkpoint_trains_as_its_fp32_copy_with_fp32_masters(sft_runs):
    runs, metrics = sft_runs
    # the bf16 -> fp32 widening is exact, so the masters start equal and every step is the same
    # computation: tolerance 0 on the losses
    assert [h["loss"] for h in history(runs["bf16"])] == [h["loss"] for h in history(runs["fp32"])]
    assert metrics["bf16"]["precision"] == {"master": "float32", "compute": "float32", "storage": "bfloat16"}
    assert metrics["fp32"]["precision"] == {"master": "float32", "compute": "float32", "storage": "float32"}
    # final/ is stored as the checkpoint came (bf16), and holds the fp32 run's weights rounded
    bf16, fp32 = weights(runs["bf16"]), weights(runs["fp32"])
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16} and {t.dtype for t in fp32.values()} == {torch.float32}
    assert bf16.keys() == fp32.keys() and all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in bf16)
    config = json.loads((runs["bf16"].out_dir / "checkpoints" / "final" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # what vLLM and transformers are told the files hold
    # the resumable checkpoints hold the masters
    assert {t.dtype for t in weights(runs["bf16"], "step_000012").values()} == {torch.float32}


def test_fp32_masters_move_the_weights_that_bf16_masters_round_away(sft_runs):
    runs, metrics = sft_runs
    moved = {name: 1 - m["weights_unchanged"]["all"] for name, m in metrics.items()}
    # the bf16 run's statistic equals the fp32 run's once rounded to bf16: the same masters
    final = runs["bf16"].out_dir / "checkpoints" / "final"
    rounded = unchanged_fraction(runs["fp32"].out_dir / "checkpoints" / "initial", final, load_model_config(final))
    assert metrics["bf16"]["weights_unchanged"] == rounded
    # 12 steps at 5e-7: bf16 masters move only what a single update can (weights near zero); fp32
    # masters accumulate updates until they cross a bf16 step (measured here: 2.6% vs 0.9% moved)
    assert moved["bf16-masters"] > 0 and moved["bf16"] > 2 * moved["bf16-masters"], moved
    assert metrics["bf16-masters"]["precision"]["master"] == "bfloat16"
    assert set(metrics["bf16"]["weights_unchanged"]) >= {"attention", "experts", "router", "embeddings", "norms", "all"}


def test_resume_after_a_signal_is_bit_identical_with_bf16_storage(hub, sft_runs, tmp_path):
    runs, _ = sft_runs
    interrupted = sft_ctx(hub, "bf16", tmp_path, preempt_before=8)
    with pytest.raises(Preempted):
        sft.run(interrupted)
    assert (interrupted.out_dir / "checkpoints" / "step_000007").is_dir()
    sft.run(sft_ctx(hub, "bf16", tmp_path))
    for name in ("final", "step_000012"):
        ours, straight = interrupted.out_dir / "checkpoints" / name, runs["bf16"].out_dir / "checkpoints" / name
        assert sha256_file(ours / "model.safetensors") == sha256_file(straight / "model.safetensors"), name
    assert [h["loss"] for h in history(interrupted)] == [h["loss"] for h in history(runs["bf16"])]


def test_a_model_trained_from_bf16_exports_and_passes_the_equivalence_check(hub, sft_runs, tmp_path):
    runs, _ = sft_runs
    final = runs["bf16"].out_dir / "checkpoints" / "final"
    values = dict(checkpoint=f"hf:{final}", dtype="bfloat16", max_new_tokens=4, probe_prompts=["hello", "12+30"])
    ctx = StageContext.standalone("export", values, run_dir=tmp_path, seed=0)
    export.run(ctx)  # raises unless the logits agree within the tolerance
    record = json.loads((ctx.out_dir / "export.json").read_text())["equivalence"]
    assert record["logits_match"] and record["greedy_match"] and record["max_abs_dlogit"] <= 1e-4
    assert (record["stored_dtype"], record["export_dtype"], record["compute_dtype"]) == ("bfloat16", "bfloat16", "float32")


def test_rl_from_bf16_equals_rl_from_fp32_and_hands_off_in_the_storage_dtype(hub, tmp_path):
    values = dict(updates=2, tasks_per_update=2, attempts=2, max_tokens=6, eval_every=0, lr=RL_LR, threads=1, lag=1)
    metrics, ctxs = {}, {}
    for source, storage in (("bf16", "float32"), ("fp32", "float32"), ("bf16", "auto")):
        name = f"{source}-{storage}"
        ctxs[name] = StageContext.standalone(
            "rl",
            values | {"init_from": f"hf:{hub / source}", "storage_dtype": storage},
            run_dir=tmp_path / name,
            inputs={"tasks": hub / "tasks"},
            seed=1,
        )
        metrics[name] = rl.run(ctxs[name])
    # fp32 masters from either copy, the same weights handed to the sampler: the same run
    same = ("loss/loss", "reward/mean", "grad_norm", "mismatch/max_abs_dlogp")
    assert [[h[k] for k in same] for h in history(ctxs["bf16-float32"])] == [
        [h[k] for k in same] for h in history(ctxs["fp32-float32"])
    ]
    assert sha256_file(ctxs["bf16-float32"].out_dir / "checkpoints" / "final" / "model.safetensors") == sha256_file(
        ctxs["fp32-float32"].out_dir / "checkpoints" / "final" / "model.safetensors"
    )
    # storage auto: the bf16 checkpoint's weight versions and final/ are bf16, the masters fp32
    auto = ctxs["bf16-auto"].out_dir
    assert metrics["bf16-auto"]["precision"] == {"master": "float32", "compute": "float32", "storage": "bfloat16"}
    versions = sorted((auto / "weights").glob("step_*"))
    assert versions
    for path in [auto / "checkpoints" / "final", *versions]:
        assert stored_dtype(path) == torch.bfloat16, path
    assert stored_dtype(auto / "checkpoints" / "step_000002") == torch.float32


def test_bad_precision_settings_name_the_key(hub, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"^stages\.sft\.storage_dtype: Invalid value 'float8_e4m3fn'"):
        stage_config("sft", {"storage_dtype": "float8_e4m3fn"})
    # a CPU without native bf16 cannot be had here (this one has AVX512-BF16): a stand-in answers no
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    ctx = sft_ctx(hub, "bf16", tmp_path, compute_dtype="bfloat16", steps=1)
    with pytest.raises(UserError, match=r"^stages\.sft\.compute_dtype: bfloat16 on a CPU without native bf16"):
        sft.run(ctx)
    assert not (ctx.out_dir / "checkpoints" / "final").exists()


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_every_backend_trains_a_bf16_checkpoint_on_fp32_masters(hub, sft_runs, tmp_path, backend):
    """The sharded (fsdp: each rank reads its bf16 rows into fp32 shards) and DeepSpeed backends
    start from the same masters as the torch backend and take the same first steps."""
    runs, _ = sft_runs
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    ctx = sft_ctx(hub, "bf16", tmp_path, backend=backend)
    metrics = sft.run(ctx)
    # the one-process group it formed is gone, and so are the variables it exported: a process
    # started next must not meet on its port (two later MPI runs of this worker hung there)
    assert {k: os.environ.get(k) for k in before} == before
    assert metrics["precision"] == {"master": "float32", "compute": "float32", "storage": "bfloat16"}
    # gradients reduced in another order: equal within float32 rounding
    assert [h["loss"] for h in history(ctx)] == pytest.approx([h["loss"] for h in history(runs["bf16"])], rel=1e-5)
    assert {t.dtype for t in weights(ctx, "step_000012").values()} == {torch.float32}


def test_the_card_states_the_dtypes_and_how_much_of_the_model_moved(sft_runs):
    from snowcat.pipeline.reports.card.training import _precision_lines  # noqa: PLC0415 (the card's one renderer of it)

    _, metrics = sft_runs
    lines = _precision_lines(metrics["bf16"])
    assert lines[0] == "  - precision: master weights and optimizer state float32, compute float32, storage bfloat16"
    same = metrics["bf16"]["weights_unchanged"]
    assert f"{same['all']:.1%}" in lines[1] and f"experts {same['experts']:.1%}" in lines[1]
    assert "bfloat16 masters, asked for in the config" in _precision_lines(metrics["bf16-masters"])[0]
    assert _precision_lines({}) == ["  - precision: not recorded"]
