"""The MoE model: parameter counts, HF Qwen3-MoE equivalence, KV cache, packing, routing, model dirs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import checkpoint_dir
from snowcat.stages.model import (
    PRESETS,
    KVCache,
    ModelConfig,
    MoEForCausalLM,
    count_params,
    hf_state_dict,
    load_model_dir,
    save_model_dir,
)

MICRO = PRESETS["test-micro"]


def make(cfg=MICRO, seed=0, **changes):
    torch.manual_seed(seed)
    return MoEForCausalLM(dataclasses.replace(cfg, **changes))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_word_embeddings": True},
        {"shared_expert_intermediate_size": 0},
        {"mlp_only_layers": [0], "dense_intermediate_size": 48},
    ],
)
def test_param_count_matches_allocated_model(changes):
    model = make(**changes)
    total, active = count_params(model.config)
    assert total == model.num_params()
    assert active < total


def test_production_preset_is_67b_total_2b_active_without_allocation():
    total, active = count_params(PRESETS["snowball-67b-a2b"])
    assert 66e9 < total < 68e9
    assert 1.8e9 < active < 2.6e9
    tiny_total, _ = count_params(PRESETS["demo-tiny"])
    assert 1e6 <= tiny_total <= 5e6


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({"hidden": 3})


def _hf_config(c: ModelConfig):
    return Qwen3MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=64,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_experts=c.num_experts,
        num_experts_per_tok=c.experts_per_token,
        moe_intermediate_size=c.moe_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
    )


def test_matches_transformers_qwen3_moe_with_our_state_dict_unrenamed():
    model = make(shared_expert_intermediate_size=0).eval()
    c = model.config
    hf = Qwen3MoeForCausalLM(_hf_config(c)).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, c.vocab_size, (2, 12))
    with torch.no_grad():
        ours = model.logits(model(ids).hidden)
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_model_dir_loads_with_transformers_from_pretrained(tmp_path):
    """Per-expert hub names on disk: transformers 5 fuses them into its 3-D experts on load."""
    model = make(shared_expert_intermediate_size=0).eval()
    save_model_dir(tmp_path / "m", model)
    _hf_config(model.config).save_pretrained(tmp_path / "m")
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.logits(model(ids).hidden), atol=1e-5, rtol=1e-4)


def test_hf_hub_names_are_per_expert():
    names = set(hf_state_dict(make()))
    for n in [
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]:
        assert n in names
    assert not any(n.endswith("gate_up_proj") for n in names)


def test_kv_cache_incremental_decoding_equals_full_forward():
    model = make().eval()
    ids = torch.randint(0, MICRO.vocab_size, (2, 11))
    with torch.no_grad():
        full = model(ids).hidden
        cache = KVCache.allocate(MICRO, 2, 16)
        parts = [model(ids[:, :5], kv_cache=cache).hidden]
        parts += [model(ids[:, t : t + 1], kv_cache=cache).hidden for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.lengths.tolist() == [11, 11]


def test_kv_cache_ragged_prefill_with_right_padding():
    model = make().eval()
    a, b = torch.randint(0, MICRO.vocab_size, (7,)), torch.randint(0, MICRO.vocab_size, (4,))
    ids = torch.zeros(2, 7, dtype=torch.long)
    ids[0], ids[1, :4] = a, b
    with torch.no_grad():
        cache = KVCache.allocate(MICRO, 2, 10)
        model(ids, kv_cache=cache)
        cache.truncate([7, 4])
        nxt = torch.tensor([[3], [5]])
        step = model(nxt, kv_cache=cache).hidden[:, 0]
        ref_a = model(torch.cat([a, nxt[0]])[None]).hidden[0, -1]
        ref_b = model(torch.cat([b, nxt[1]])[None]).hidden[0, -1]
    torch.testing.assert_close(step, torch.stack([ref_a, ref_b]), atol=1e-5, rtol=1e-4)


def test_packed_segments_do_not_attend_across_examples():
    model = make().eval()
    ids = torch.randint(0, MICRO.vocab_size, (1, 10))
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        packed = model(ids, segment_ids=seg).hidden
        separate = torch.cat([model(ids[:, :4]).hidden, model(ids[:, 4:]).hidden], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-4)


def test_router_losses_train_the_router_and_stats_are_reported():
    model = make()
    out = model(torch.randint(0, MICRO.vocab_size, (2, 16)))
    (out.aux_loss + out.z_loss).backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    load = out.router_stats["expert_load"]
    assert load.shape == (MICRO.num_layers, MICRO.num_experts)
    torch.testing.assert_close(load.sum(dim=1), torch.ones(MICRO.num_layers))
    assert float(out.router_stats["dropped_fraction"]) == 0.0  # dropless by default


def test_capacity_factor_drops_overflow_tokens():
    model = make(expert_capacity_factor=0.25)
    out = model(torch.randint(0, MICRO.vocab_size, (2, 16)))
    assert float(out.router_stats["dropped_fraction"]) > 0


def test_model_dir_roundtrip_sharded_and_manifest_checked(tmp_path):
    model = make(tie_word_embeddings=True)
    save_model_dir(tmp_path / "ckpt", model, meta={"step": 3}, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded, cfg, tok = load_model_dir(tmp_path / "ckpt")
    assert cfg == model.config and tok is None
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, MICRO.vocab_size, (1, 6))
    torch.testing.assert_close(loaded(ids).hidden, model(ids).hidden)
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(UserError, match="sha256"):
        load_model_dir(tmp_path / "ckpt")


def test_checkpoint_reference_follows_pointer_file(tmp_path):
    save_model_dir(tmp_path / "checkpoints" / "final", make())
    (tmp_path / "checkpoints" / "best").write_text("final\n")
    assert checkpoint_dir(tmp_path, "best") == tmp_path / "checkpoints" / "final"
    with pytest.raises(UserError):
        checkpoint_dir(tmp_path, "step_000001")
