"""Training backend: schedule, packing, accumulation invariance, checkpoints, bit-identical resume."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from snowcat.pipeline.fsio import sha256_file, verify_manifest
from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.train import (
    Example,
    OptimConfig,
    PackedLoader,
    latest_checkpoint,
    load_checkpoint,
    lr_factor,
    make_backend,
    pack_rows,
    save_checkpoint,
    step_name,
)
from snowcat.stages.train.backend import NonFiniteGradient
from snowcat.stages.train.loss import sft_loss

REPO = Path(__file__).resolve().parent.parent
MICRO = PRESETS["test-micro"]


def toy_examples(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(5, 20, (1,), generator=g))
        ids = torch.randint(20, MICRO.vocab_size, (L,), generator=g).tolist()
        prompt = L // 2
        out.append(Example(ids, [0] * prompt + [1] * (L - prompt), i % 2))
    return out


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.55)
    assert lr_factor(110, cfg) == pytest.approx(0.1) and lr_factor(500, cfg) == pytest.approx(0.1)
    lin = dataclasses.replace(cfg, schedule="linear")
    assert lr_factor(60, lin) == pytest.approx(0.55)
    with pytest.raises(ValueError):
        OptimConfig(schedule="exp")


def test_packing_keeps_examples_apart():
    exs = [
        Example([1, 2, 3, 4], [0, 0, 1, 1], 0),
        Example([5, 6, 7], [0, 1, 1], 1),
        Example([8, 9, 10, 11, 12, 13], [0] * 3 + [1] * 3, 0),
    ]
    rows = pack_rows(exs, seq_len=8, pad_id=0)
    assert rows["input_ids"].shape == (2, 8)
    assert rows["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert rows["segment_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    assert rows["position_ids"][0, :7].tolist() == [0, 1, 2, 3, 0, 1, 2]
    # targets: next token where it is trained; never across the example boundary
    assert rows["targets"][0].tolist() == [-1, 3, 4, -1, 6, 7, -1, -1]
    assert rows["domain_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]


def _train(backend_name="torch", steps=4, micro=1, seed=0, cfg=MICRO):
    torch.manual_seed(seed)
    model = MoEForCausalLM(cfg)
    backend = make_backend(backend_name, model, OptimConfig(lr=1e-2, warmup_steps=2, total_steps=steps))
    loader = PackedLoader(toy_examples(), seq_len=32, pad_id=0, batch_rows=4, seed=seed, micro_batches=micro)
    losses = [backend.train_step(loader.next(), sft_loss) for _ in range(steps)]
    return model, [float(s.sums["nll_sum"]) / s.tokens for s in losses]


def test_loss_decreases():
    _, losses = _train(steps=8)
    assert losses[-1] < losses[0]


def test_gradient_accumulation_does_not_change_the_update():
    # The token-mean NLL is normalised over the whole step; the router losses are per micro-batch
    # (a product of means is not additive), so they are switched off for this comparison.
    cfg = dataclasses.replace(MICRO, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    one, l1 = _train(micro=1, steps=3, cfg=cfg)
    two, l2 = _train(micro=2, steps=3, cfg=cfg)
    for a, b in zip(one.parameters(), two.parameters()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert l1 == pytest.approx(l2, rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_step_with_a_non_finite_gradient_is_refused_and_changes_no_weight(bad):
    """One NaN would pass clipping and the optimizer into every weight and every later checkpoint:
    the step stops before the optimizer runs, naming the step and its loss."""
    torch.manual_seed(0)
    model = MoEForCausalLM(MICRO)
    backend = make_backend("torch", model, OptimConfig(lr=1e-2, warmup_steps=0, total_steps=3, grad_clip=1.0))
    loader = PackedLoader(toy_examples(), seq_len=32, pad_id=0, batch_rows=4, seed=0)
    backend.train_step(loader.next(), sft_loss)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in backend.optimizer.state_dict()["state"][0].items()}

    def poisoned(model, batch, n_tokens, n_micro):
        loss, stats = sft_loss(model, batch, n_tokens, n_micro)
        return loss * bad, stats

    with pytest.raises(
        NonFiniteGradient, match=r"step 2: gradient norm (nan|inf) .*weights and the last checkpoint are those of step 1"
    ):
        backend.train_step(loader.next(), poisoned)
    assert backend.step == 1 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[k]) for k, v in backend.optimizer.state_dict()["state"][0].items())


def test_loader_resumes_at_the_same_batch():
    a = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=3)
    seen = [a.next() for _ in range(9)]  # crosses an epoch boundary
    b = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=3)
    c = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=3)
    for _ in range(5):
        c.next()
    b.load_state_dict(c.state_dict())
    for want in seen[5:]:
        got = b.next()
        assert torch.equal(got[0]["input_ids"], want[0]["input_ids"])


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    from snowcat.stages.model import PRESETS, MoEForCausalLM
    from snowcat.stages.train import OptimConfig, PackedLoader, load_checkpoint, make_backend, save_checkpoint
    from snowcat.stages.train.loss import sft_loss
    sys.path.insert(0, "tests")
    from test_train import toy_examples
    mode, ckpt, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = MoEForCausalLM(PRESETS["test-micro"])
    backend = make_backend("torch", model, OptimConfig(lr=1e-2, warmup_steps=2, total_steps=total))
    loader = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=0)
    if mode == "resume":
        client = load_checkpoint(ckpt, backend)
        loader.load_state_dict(client["loader"])
    while backend.step < total:
        backend.train_step(loader.next(), sft_loss)
    save_checkpoint(sys.argv[4], backend, client_state={"loader": loader.state_dict()})
""")


@pytest.mark.slow  # ~9 s on 2 cores: two fresh interpreters train
def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    total, k = 6, 3
    torch.manual_seed(0)
    model = MoEForCausalLM(MICRO)
    backend = make_backend("torch", model, OptimConfig(lr=1e-2, warmup_steps=2, total_steps=total))
    loader = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=0)
    while backend.step < total:
        backend.train_step(loader.next(), sft_loss)
        if backend.step == k:
            save_checkpoint(tmp_path / step_name(k), backend, client_state={"loader": loader.state_dict()})
    save_checkpoint(tmp_path / "straight", backend, client_state={"loader": loader.state_dict()})
    assert verify_manifest(tmp_path / step_name(k)) == []

    subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, "resume", str(tmp_path / step_name(k)), str(total), str(tmp_path / "resumed")],
        cwd=REPO,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
    )
    assert sha256_file(tmp_path / "resumed" / "model.safetensors") == sha256_file(tmp_path / "straight" / "model.safetensors")


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = MoEForCausalLM(MICRO)
    backend = make_backend("torch", model, OptimConfig(total_steps=4))
    loader = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=0)
    backend.train_step(loader.next(), sft_loss)
    save_checkpoint(tmp_path / step_name(1), backend, client_state={"loader": loader.state_dict()})
    backend.train_step(loader.next(), sft_loss)

    def killed(*a, **k):
        raise KeyboardInterrupt("killed while writing the manifest")

    monkeypatch.setattr("snowcat.stages.model.io.write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / step_name(2), backend, client_state={"loader": loader.state_dict()})
    assert not (tmp_path / step_name(2)).exists()
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(1)
    assert verify_manifest(tmp_path / step_name(1)) == []

    # a checkpoint whose files no longer match the manifest is never resumed from
    monkeypatch.undo()
    save_checkpoint(tmp_path / step_name(2), backend, client_state={"loader": loader.state_dict()})
    (tmp_path / step_name(2) / "model_config.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(1)
    client = load_checkpoint(tmp_path / step_name(1), backend)
    assert client["step"] == 1 and backend.step == 1
