"""A Megatron GPTModel chunk behind the forward the trainers' losses call (stages.model.ModelOutput).

    model = MegatronCausalLM(gpt, model_cfg)
    out = model(input_ids, targets=..., temperature=..., routes=..., kept_support=...)

The losses (SFT's, RL's TIS policy loss) are shared with the other backends, unchanged: they call
the model with targets and read per-token logprobs and entropies from the same fused kernel
(`kernels.linear_logprob_entropy`), which takes the LM head's vocabulary shard under tensor
parallelism (`tp_group`) and never builds [tokens, vocab] logits. The final hidden states come
out of the sequence-parallel region whole on every tensor-parallel rank (their gradient: each
rank's own slice, since the kernel already sums the shards' contributions).

Router losses are megatron's own (its router adds the aux and z losses' gradients with the
coefficients of the model config), so `aux_loss`/`z_loss` here are zeros for the shared loss.
`routes` [B, T, moe layers * k] replays recorded expert choices in megatron's router (-1: the
token routes itself); `out.routes` holds the router's own choices when the whole model is here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from snowcat.kernels import linear_logprob_entropy
from snowcat.stages.model.config import ModelConfig
from snowcat.stages.model.modeling import ModelOutput


class _Routes:
    """Stands in a router's `router_replay`: records the experts the router chose, and forces the
    recorded ones where given ([tokens, k], -1 rows: the router's own choice)."""

    def __init__(self, forced: torch.Tensor | None):
        self.forced, self.chosen = forced, None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.chosen = idx.detach()
        if self.forced is None:
            return values, idx
        forced = self.forced.to(idx.device)
        idx = torch.where((forced >= 0).all(dim=-1, keepdim=True), forced, idx)
        return scores.gather(1, idx), idx


def _document_mask(segment_ids: torch.Tensor | None) -> torch.Tensor | None:
    """[B, 1, T, T] True where attention is masked (later tokens, other documents); None: causal only."""
    if segment_ids is None:
        return None
    T = segment_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return ~(causal & same)[:, None]


class MegatronCausalLM(nn.Module):
    def __init__(self, gpt: nn.Module, config: ModelConfig):
        super().__init__()
        self.gpt, self.config = gpt, config
        from megatron.core import parallel_state

        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.first_layer = parallel_state.get_pipeline_model_parallel_rank() * (config.num_layers // self.pp)
        self.routers = [layer.mlp.router for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")]

    @property
    def post_process(self) -> bool:
        return self.gpt.post_process

    def lm_head(self) -> torch.Tensor:
        """This rank's vocabulary shard of the LM head ([V / tp, H])."""
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def set_input_tensor(self, tensor) -> None:
        self.gpt.set_input_tensor(tensor)

    def forward(
        self,
        input_ids,
        position_ids=None,
        segment_ids=None,
        targets=None,
        temperature: float = 1.0,
        routes=None,
        kept_support=None,
    ) -> ModelOutput | torch.Tensor:
        """ModelOutput on the last pipeline stage; the hidden states to send on, on the others.
        `segment_ids` (packed rows): each document attends to itself only. Rotary embeddings make
        attention depend on relative positions alone, so the row's running positions serve every
        document (`position_ids` is not needed)."""
        B, length = input_ids.shape
        # sequence parallelism splits the sequence over TP ranks: padded at the end to a multiple of
        # TP (causal attention: no real token sees a pad), the pads kept out of the router's losses
        pad = (-length) % self.tp
        padding_mask = None
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            segment_ids = None if segment_ids is None else F.pad(segment_ids, (0, pad), value=-1)
            targets = None if targets is None else F.pad(targets, (0, pad), value=-1)
            routes = None if routes is None else F.pad(routes, (0, 0, 0, pad), value=-1)
            padding_mask = torch.zeros_like(input_ids, dtype=torch.bool)
            padding_mask[:, length:] = True
        T = length + pad
        recorders = self._install_routes(routes, B, T)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        try:
            hidden = self.gpt(input_ids, positions, _document_mask(segment_ids), padding_mask=padding_mask)
        finally:
            for router in self.routers:
                router.router_replay = None
        if not self.post_process:
            return hidden
        hidden = self._whole_sequence(hidden).transpose(0, 1)[:, :length]  # [B, T, H]
        zero = hidden.new_zeros((), dtype=torch.float32)
        out = ModelOutput(hidden=hidden, aux_loss=zero, z_loss=zero, router_stats=self._router_stats(recorders))
        if self.pp == 1 and recorders:
            chosen = [self._whole_sequence(r.chosen.view(-1, B, r.chosen.shape[-1])).transpose(0, 1) for r in recorders]
            out.routes = torch.stack(chosen, dim=2)[:, :length]  # [B, T, layers, k]
        if targets is not None:
            targets = targets[:, :length]
            sel = targets >= 0
            h, head = hidden[sel], self.lm_head().to(hidden.dtype)
            support = None
            if kept_support is not None:
                with torch.no_grad():  # a rebuilt support needs the whole head (rare: engines record it)
                    support = kept_support(h, self._whole_head(head))
            logp, ent = linear_logprob_entropy(
                h, head, targets[sel], temperature=temperature, support=support, tp_group=self.tp_group
            )
            out.logprobs = logp.new_zeros(B, length).masked_scatter(sel, logp)
            out.entropy = ent.new_zeros(B, length).masked_scatter(sel, ent)
        return out

    def _install_routes(self, routes, B: int, T: int) -> list[_Routes]:
        """One recorder per MoE router of this stage, forcing `routes`' experts for its layer on
        the tokens of this rank's sequence slice, in the router's order (sequence-major)."""
        k = self.config.experts_per_token
        forced = None
        if routes is not None:
            forced = routes.reshape(B, T, -1, k).transpose(0, 1)  # [T, B, layers, k]
            if self.tp > 1:  # sequence parallel: this rank routes its slice of the sequence
                from megatron.core import parallel_state

                rank, n = parallel_state.get_tensor_model_parallel_rank(), self.tp
                forced = forced[rank * T // n : (rank + 1) * T // n]
        recorders = []
        for i, router in enumerate(self.routers):
            layer = forced[:, :, self.first_layer + i].reshape(-1, k) if forced is not None else None
            router.router_replay = _Routes(layer)
            recorders.append(router.router_replay)
        return recorders

    def _whole_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[s / tp, ...] sequence-parallel slices -> [s, ...] on every TP rank; the gradient of
        the whole is already the same on every rank, so each keeps its slice's."""
        if self.tp == 1:
            return x
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if not x.is_floating_point():
            with torch.no_grad():
                return gather_from_sequence_parallel_region(x.float(), tensor_parallel_output_grad=False).to(x.dtype)
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)

    def _whole_head(self, head: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return head
        parts = [torch.empty_like(head) for _ in range(self.tp)]
        torch.distributed.all_gather(parts, head.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    def _router_stats(self, recorders: list[_Routes]) -> dict:
        """Expert load of this rank's tokens: the fraction of routed copies per expert, and its
        max over mean (1 = balanced), averaged over this stage's MoE layers."""
        if not recorders or recorders[0].chosen is None:
            return {}
        E = self.config.num_experts
        load = torch.stack([torch.bincount(r.chosen.reshape(-1), minlength=E).float() for r in recorders])
        load = load / load.sum(dim=1, keepdim=True).clamp(min=1)
        return {"expert_load": load, "load_max_over_mean": (load.max(dim=1).values * E).mean()}
