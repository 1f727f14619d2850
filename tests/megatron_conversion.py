"""One process, for tests/test_megatron.py: the Megatron model converted from a model directory
against the Hugging Face model (transformers) and our own, on the same weights.

    python tests/megatron_conversion.py MODEL_DIR OUT.json

Writes the largest differences it measured: logprobs vs transformers' log-softmax and vs our
model's, entropies, the HF -> Megatron -> HF round trip (exact or not), and router replay (the
same forced experts in both implementations) with the differences it makes. A model with a shared
expert has no single transformers architecture: it is compared with transformers' modules composed
(`transformers_model`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def transformers_model(cfg, ours):
    """transformers' own modules for a model with a shared expert, which no single architecture of
    theirs has with Qwen3's attention (Qwen3-MoE has no shared expert; Qwen2-MoE, whose MoE block
    ours follows, has no q/k norms and biases on q, k, v): Qwen3-MoE with every MoE block replaced
    by Qwen2-MoE's, holding our weights (the same names: strict)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    from snowcat.stages.train.megatron.bridge import hf_config

    config = hf_config(cfg)
    model = Qwen3MoeForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp = Qwen2MoeSparseMoeBlock(config)
    model.load_state_dict(ours.state_dict(), strict=True)
    return model.float().eval()


def main(model_dir: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from snowcat.stages.model.io import distinct_tensors, load_weights, open_model_dir
    from snowcat.stages.train.megatron import Layout, MegatronBackend
    from snowcat.stages.train.optim import OptimConfig

    cfg, _ = open_model_dir(model_dir)
    ours = load_weights(model_dir, cfg)
    backend, _ = MegatronBackend.from_model_dir(model_dir, OptimConfig(), Layout())
    mega = backend.model.eval()
    if cfg.shared_expert_intermediate_size:
        hf = transformers_model(cfg, ours)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    with torch.no_grad():
        m = mega(ids, targets=targets)
        o = ours(ids, targets=targets)
        ref = torch.log_softmax(hf(ids).logits.float(), -1).gather(-1, targets[..., None])[..., 0]
        forced = torch.stack(
            [torch.randperm(cfg.num_experts, generator=g)[: cfg.experts_per_token] for _ in range(2 * 16 * cfg.num_layers)]
        )
        forced = forced.view(2, 16, cfg.num_layers * cfg.experts_per_token)
        m_forced = mega(ids, targets=targets, routes=forced)
        o_forced = ours(ids, targets=targets, routes=forced)
        shared = [layer.mlp.shared_expert.down_proj.weight for layer in ours.model.layers if hasattr(layer.mlp, "shared_expert")]
        kept = [w.clone() for w in shared]
        for w in shared:  # what the shared experts contribute: a model without them differs by this much
            w.zero_()
        o_unshared = ours(ids, targets=targets)
        for w, k in zip(shared, kept, strict=True):
            w.copy_(k)
    exported = dict(backend.whole_tensors())
    original = {name: t.detach() for name, t in distinct_tensors(ours)}  # our names: experts fused per layer
    result = {
        "logprob_vs_transformers": float((m.logprobs - ref).abs().max()),
        "logprob_vs_ours": float((m.logprobs - o.logprobs).abs().max()),
        "entropy_vs_ours": float((m.entropy - o.entropy).abs().max()),
        "routes_agree": float((m.routes.sort(-1).values == o.routes.sort(-1).values).float().mean()),
        "round_trip_names_equal": sorted(exported) == sorted(original),
        "round_trip_exact": all(torch.equal(exported[k], original[k]) for k in original if k in exported),
        "shared_experts": len(shared),
        "shared_expert_changes_logprobs": float((o_unshared.logprobs - o.logprobs).abs().max()),
        "replay_vs_ours": float((m_forced.logprobs - o_forced.logprobs).abs().max()),
        "replay_changes_logprobs": float((m_forced.logprobs - m.logprobs).abs().max()),
        # under replay both report the router's own choice, as the engine-vs-trainer agreement needs
        "replay_own_choices_agree": bool((m_forced.routes.sort(-1).values == o_forced.routes.sort(-1).values).all()),
    }
    out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
