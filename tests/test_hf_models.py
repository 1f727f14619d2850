"""Hugging Face checkpoints in: snowcat's model equals transformers on the same files.

Small random checkpoints are built here with transformers itself (`<Arch>ForCausalLM(config)
.save_pretrained`), one file and sharded; head_dim stays >= 32 (vLLM's CPU attention rejects 16).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import snowcat.stages.sft as sft
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import sha256_file
from snowcat.stages import export
from snowcat.stages.hf_tokenizer import HFChatTokenizer
from snowcat.stages.model import count_params, load_model_dir
from snowcat.stages.model.hf import hf_model_type, model_config_from_hf, read_hf_config
from snowcat.stages.model.io import hf_state_dict
from snowcat.stages.model.tiny_hf import tiny_checkpoint
from snowcat.stages.taskgen import demonstration, generate_domain, save_tasks, split_tasks
from tests.conftest import REPO, Snowcat

COMMON = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128
)

ARCHES = {
    # experts in layers 1 and 2 only (decoder_sparse_step 2 and mlp_only_layers), renormalised top-k
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    ),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, intermediate_size=96, tie_word_embeddings=True),
    # OLMoE's head_dim is hidden_size / heads: 64 / 2 = 32
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
}


def _save(cfg, path, seed: int, **kwargs):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms start at 1: randomise them so a mixed-up norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **kwargs)
    return model.eval()


@pytest.fixture(scope="module", params=list(ARCHES))
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf_model = _save(ARCHES[request.param](), root / "single", seed=0)
    shutil.copytree(root / "single", root / "sharded")
    (root / "sharded" / "model.safetensors").unlink()
    hf_model.save_pretrained(root / "sharded", max_shard_size="40KB")
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 2
    return request.param, hf_model, root


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_logits_equal_transformers(checkpoint, layout):
    arch, hf_model, root = checkpoint
    model, cfg, _ = load_model_dir(root / layout)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids).logits
        got = model.logits(model(ids).hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert hf_model_type(cfg) == arch  # what export will write back
    total, _ = count_params(cfg)
    assert total == sum(p.numel() for p in hf_model.parameters())


def test_mapped_config_keeps_what_matters():
    qwen = model_config_from_hf(ARCHES["qwen3_moe"]().to_dict(), "config.json")
    assert qwen.mlp_only_layers == [0] and qwen.dense_intermediate_size == 96 and qwen.norm_topk_prob
    assert qwen.rope_theta == 5000.0 and qwen.head_dim == 32 and qwen.router_z_loss_coef == 0.0
    step = model_config_from_hf({**ARCHES["qwen3_moe"]().to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": []}, "c")
    assert step.mlp_only_layers == [0, 2]  # HF: layer i is sparse iff (i + 1) % step == 0
    olmoe = model_config_from_hf(ARCHES["olmoe"]().to_dict(), "c")
    assert olmoe.qk_norm == "full" and olmoe.moe_intermediate_size == 32 and not olmoe.mlp_only_layers


@pytest.mark.parametrize(
    "change, error",
    [
        ({"model_type": "mixtral"}, r"model_type='mixtral' is not supported \(supported: qwen3_moe, qwen3, olmoe\)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, r"rope_parameters\.rope_type='yarn'"),
        ({"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window=True: sliding-window attention"),
        ({"attention_bias": True}, r"attention_bias=True"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, r"num_heads=2 is not a multiple of num_kv_heads=3"),
    ],
)
def test_unsupported_features_are_refused_by_name(tmp_path, change, error):
    cfg = {**ARCHES["qwen3_moe"]().to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=rf"^{tmp_path}/config\.json: {error}"):
        load_model_dir(tmp_path)


def test_missing_shard_and_missing_tensor_name_the_file(tmp_path, checkpoint):
    _, _, root = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(root / "sharded", broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(UserError, match=rf"model\.safetensors\.index\.json: shard {shard.name} is missing"):
        load_model_dir(broken)
    assert read_hf_config(broken)["model_type"]

    pruned = tmp_path / "pruned"
    shutil.copytree(root / "single", pruned)
    tensors = load_file(pruned / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, pruned / "model.safetensors")
    with pytest.raises(UserError, match=r"pruned: missing tensor model\.norm\.weight \(1 missing, 0 unexpected"):
        load_model_dir(pruned)


def test_a_checkpoint_without_config_is_not_a_model(tmp_path):
    with pytest.raises(UserError, match="not a model directory"):
        load_model_dir(tmp_path)


# ---------------------------------------------------------------- hf: sources in stages


def small_task_set(out) -> list[str]:
    """A seeded closure + arith task set in `out` (train and val splits); the train tasks' prompts
    and demonstrations, the texts a tiny checkpoint's tokenizer is trained on."""
    rng = np.random.default_rng(0)
    train, val = [], []
    for domain, diffs in [("closure", [1, 2]), ("arith", [2])]:
        tr, va = split_tasks(generate_domain(rng, domain, diffs, 24), 4, rng)
        train, val = train + tr, val + va
    save_tasks(out, "train", train)
    save_tasks(out, "val", val)
    return [t.prompt for t in train] + [demonstration(t) for t in train]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):

    root = tmp_path_factory.mktemp("tiny-hf")
    hf_model = tiny_checkpoint(root / "model", small_task_set(root / "tasks"))
    (root / "model" / "README.md").write_text(
        "---\nlicense: apache-2.0\nlibrary_name: transformers\nbase_model:\n- org/base-a\n- org/specialist-b\n"
        "base_model_relation: merge\n---\n# tiny\n"
    )
    return root, hf_model


def test_sft_starts_from_an_hf_checkpoint_with_its_tokenizer(tiny_hf, capsys):
    root, _ = tiny_hf
    values = dict(
        model=f"hf:{root / 'model'}", steps=3, seq_len=96, batch_rows=4, warmup_steps=1, lr=1e-3, eval_tasks=2, threads=1
    )
    ctx = StageContext.standalone("sft", values, run_dir=root / "run", inputs={"tasks": root / "tasks"}, seed=3)
    metrics = sft.run(ctx)
    assert "qwen3_moe:" in capsys.readouterr().out and metrics["steps"] == 3  # the size, printed before loading
    ckpts = ctx.out_dir / "checkpoints"
    initial, _, tok = load_model_dir(ckpts / "initial")
    assert hf_state_dict(initial).keys() == load_file(root / "model" / "model.safetensors").keys()
    for name, t in load_file(root / "model" / "model.safetensors").items():
        assert torch.equal(hf_state_dict(initial)[name], t), name  # bit for bit, before any update
    assert isinstance(tok, HFChatTokenizer) and tok.fingerprint() == HFChatTokenizer.load(root / "model").fingerprint()
    meta = json.loads((ckpts / "initial" / "meta.json").read_text())
    lineage = meta["lineage"]
    assert lineage["source"] == values["model"] and lineage["hub_id"] is None  # a local directory
    assert lineage["license"] == "apache-2.0"  # from the model card's front matter
    assert lineage["parents"] == ["org/base-a", "org/specialist-b"] and lineage["parents_relation"] == "merge"
    assert lineage["files"]["model.safetensors"] == sha256_file(root / "model" / "model.safetensors")
    final, _, final_tok = load_model_dir(ckpts / "final")
    assert isinstance(final_tok, HFChatTokenizer)
    assert not torch.equal(final.lm_head.weight, initial.lm_head.weight)  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHES))
def test_export_of_an_hf_checkpoint_is_the_same_model_and_tokenizer(tmp_path, arch):

    source = tmp_path / "source"
    tiny_checkpoint(source, ["What is 12+30?", "42", "hello world"], arch=arch)
    values = dict(checkpoint=f"hf:{source}", max_new_tokens=4, probe_prompts=["hello", "12+30"])
    ctx = StageContext.standalone("export", values, run_dir=tmp_path / "run", seed=0)
    export.run(ctx)  # raises unless transformers, offline, gives the same logits, greedy tokens and template ids
    out = ctx.out_dir / "model"
    record = json.loads((ctx.out_dir / "export.json").read_text())
    assert record["format"]["architecture"] == read_hf_config(source)["architectures"][0]
    got, want = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (source / name).read_bytes()


@pytest.mark.slow
def test_hf_tiny_config_runs_from_a_staged_checkpoint_to_a_card_with_its_lineage(tmp_path):
    """configs/hf-tiny.yaml as a user runs it: `snowcat tiny-hf`, then the run (its artefact path and
    run root pointed into tmp_path)."""
    snowcat = Snowcat(tmp_path)
    snowcat("tiny-hf", tmp_path / "tiny", check=True)
    config = (REPO / "configs" / "hf-tiny.yaml").read_text().replace("path: logs/tiny-hf/qwen3_moe", f"path: {tmp_path / 'tiny'}")
    (tmp_path / "hf-tiny.yaml").write_text(config)
    snowcat(
        "run", tmp_path / "hf-tiny.yaml", "--run-dir", tmp_path / "run", "run_root=" + str(tmp_path), check=True, timeout=1500
    )
    run = tmp_path / "run" / "stages"

    index = json.loads((tmp_path / "staged" / "index.json").read_text())["artefacts"]["snowcat/tiny-qwen3-moe"]
    card = (run / "card" / "card.md").read_text()
    assert "pretrained checkpoint `hf:snowcat/tiny-qwen3-moe`" in card and "hub id `snowcat/tiny-qwen3-moe`" in card
    assert "license apache-2.0" in card and f"staged copy sha256 `{index['sha256']}`" in card
    assert f"`model.safetensors` sha256 `{sha256_file(tmp_path / 'tiny' / 'model.safetensors')}`" in card
    assert "base_model: snowcat/tiny-qwen3-moe" in card

    record = json.loads((run / "export" / "export.json").read_text())
    assert record["format"]["architecture"] == "Qwen3MoeForCausalLM" and record["equivalence"]["logits_match"]
    assert (run / "export" / "model" / "tokenizer.json").read_bytes() == (tmp_path / "tiny" / "tokenizer.json").read_bytes()
    results = json.loads((run / "eval" / "results.json").read_text())
    assert set(results["checkpoints"]) == {"sft:initial", "sft:final"}


def test_snowcat_config_shows_the_size_of_an_hf_model(tmp_path, tiny_hf):
    root, _ = tiny_hf
    (tmp_path / "c.yaml").write_text(f"stages:\n  sft: {{kind: sft, model: 'hf:{root / 'model'}'}}\n")
    out = Snowcat(tmp_path)("config", tmp_path / "c.yaml", check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("# stages.sft.model"))
    total, active = count_params(load_model_dir(root / "model")[1])
    assert f"qwen3_moe: {total / 1e6:,.2f} M parameters ({active / 1e6:,.2f} M active per token)" in line


def test_rl_and_probe_run_from_an_hf_checkpoint(tmp_path, tiny_hf):
    """RL (rollouts through the agent loop with the checkpoint's chat template) and probe from hf:."""
    from snowcat.stages import probe, rl  # noqa: PLC0415 (stage modules, only this test needs them)

    root, _ = tiny_hf
    source = f"hf:{root / 'model'}"
    values = dict(init_from=source, updates=2, tasks_per_update=2, attempts=2, max_tokens=6, eval_every=2, eval_tasks=4)
    ctx = StageContext.standalone("rl", values | {"threads": 1}, run_dir=tmp_path, inputs={"tasks": root / "tasks"}, seed=1)
    metrics = rl.run(ctx)
    assert metrics["updates"] == 2 and "val/pass@1" in metrics
    _, _, tok = load_model_dir(ctx.out_dir / "checkpoints" / "final")
    assert isinstance(tok, HFChatTokenizer)
    values = dict(checkpoint=source, limit=4, attempts=2, band_min_pass=1, band_max_pass=1, max_turn_tokens=6, batch_size=8)
    ctx = StageContext.standalone("probe", values, run_dir=tmp_path, inputs={"tasks": root / "tasks"}, seed=1)
    assert probe.run(ctx)["tasks"] == 4
