"""The RL objective on a batch of trajectories: advantages, padded tensors, the policy loss.

Logprobs are recomputed under the *sampling* distribution, not the raw model: the same
temperature, and for top-k/top-p sampling the same kept support passed to
`kernels.linear_logprob_entropy(..., support=)`; otherwise every importance ratio is off by
log(kept mass) (see /docs/rl.md). The support is the one the engine actually sampled from, carried
with each token: rebuilding it from the trainer's logits disagrees at ties (vLLM's top-p keeps tied
tokens by sorted position) and needs fp32 [chunk, V] logits. Only tokens whose support the engine did
not report are rebuilt, and `mismatch/support_rebuilt_frac` counts them.

Teacher rollouts (`rl.teacher_rollouts`): the teacher's episodes share their task's group for the
advantage; their `rollout_logprobs` are the teacher engine's, so the TIS weight of their tokens is
min(π_old/π_teacher, tis_cap): off-policy importance sampling, capped. π is the policy's own sampling
distribution: the teacher's kept supports are not used (rebuilt from the trainer's logits). The
engine-vs-trainer mismatch and staleness are statistics of the policy's rows only (`teacher_rows`);
the teacher's rows get `teacher/*` statistics of their own.

Summarised episodes (`rl.context`): a row is a record, not an episode; an episode's records share the
one advantage its reward earns in its group (`trajectory_advantages`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from snowcat.stages.agent import Trajectory
from snowcat.stages.agent.trajectory import flatten
from snowcat.stages.algorithms import PolicyLossConfig, episode_advantages, masked_mean, mismatch_stats, policy_loss
from snowcat.stages.rollout import SamplingParams, support_ids
from snowcat.stages.train.packing import Repacked


def update_rows(trajs: list[Trajectory]) -> list[Trajectory]:
    """The records an update trains on, one row each, in order: every record of every episode (an
    episode whose context a summary rewrote is several, each trained in the context it was sampled
    in; stages/agent/context.py), none holding the others: update_rows(update_rows(x)) == update_rows(x)."""
    return flatten(trajs)


def trajectory_advantages(trajs: list[Trajectory], estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage [N], trainable [N]) of the N rows of `trajs` (`update_rows`), grouped by `group_id`:
    an episode, (group_id, attempt), is one member of its group however many records it has, and its
    records share its advantage (`algorithms.episode_advantages`)."""
    rows = update_rows(trajs)
    columns = ([t.group_id for t in rows], [t.attempt for t in rows], [t.reward for t in rows], [t.trainable for t in rows])
    return episode_advantages(*columns, estimator)


def make_batch(trajs: list[Trajectory], pad_id: int, estimator: str) -> dict[str, torch.Tensor]:
    """Right-padded [B, L-1] tensors, one row per record (`update_rows`): next-token targets where the
    model sampled, -1 elsewhere."""
    adv, trainable = trajectory_advantages(trajs, estimator)
    trajs = update_rows(trajs)
    length = max(len(t) for t in trajs)
    B = len(trajs)
    ids = np.full((B, length), pad_id, np.int64)
    mask = np.zeros((B, length), np.float32)
    lp = np.zeros((B, length), np.float32)
    for b, t in enumerate(trajs):
        n = len(t)
        ids[b, :n], lp[b, :n] = t.token_ids, t.rollout_logprobs
        mask[b, :n] = t.loss_mask * float(t.trainable)  # infra failures carry no loss at all
    ids, mask, lp = map(torch.from_numpy, (ids, mask, lp))
    targets = torch.where(mask[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], -1))
    return {
        "input_ids": ids[:, :-1],
        "lengths": torch.tensor([min(len(t), length - 1) for t in trajs]),  # real input positions per row
        "targets": targets,
        "mask": mask[:, 1:],
        "rollout_logprobs": lp[:, 1:],
        "support": support_tensor(trajs, length)[:, 1:],
        **({"routes": routes_tensor(trajs, length)[:, :-1]} if any(t.routes is not None for t in trajs) else {}),
        "advantages": adv,
        "trainable": trainable,
        "teacher_rows": torch.tensor([float(t.source == "teacher") for t in trajs]),
    }


def support_tensor(trajs: list[Trajectory], length: int) -> torch.Tensor:
    """int64 [B, length, K]: each token's recorded kept ids, padded with -1 (K = 0 when none recorded)."""
    width = max((int(t.support_lengths.max(initial=0)) for t in trajs if t.source != "teacher"), default=0)
    out = np.full((len(trajs), length, width), -1, np.int64)
    for b, t in enumerate(trajs):
        if t.source == "teacher":  # the teacher's kept sets are not the policy's sampling distribution
            continue
        n = t.support_lengths.astype(np.int64)
        rows = np.repeat(np.arange(len(t)), n)
        cols = np.arange(len(t.support_ids)) - np.repeat(np.cumsum(n) - n, n)
        out[b, rows, cols] = t.support_ids
    return torch.from_numpy(out)


def routes_tensor(trajs: list[Trajectory], length: int) -> torch.Tensor:
    """int64 [B, length, moe layers * k]: each input token's recorded experts, -1 where not recorded."""
    width = max(t.routes.shape[1] for t in trajs if t.routes is not None)
    out = np.full((len(trajs), length, width), -1, np.int64)
    for b, t in enumerate(trajs):
        if t.routes is not None:
            out[b, : len(t)] = t.routes
    return torch.from_numpy(out)


def route_agreement(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """Share of (token, MoE layer) pairs whose recorded expert set the trainer's router chose too.
    `own` [B, T, layers, k] (ModelOutput.routes), `recorded` [B, T, layers * k] (-1: not recorded)."""
    rec = recorded.view(own.shape)
    valid = (rec >= 0).all(dim=-1)
    same = (own.sort(dim=-1).values == rec.sort(dim=-1).values).all(dim=-1)
    return (same & valid).sum() / valid.sum().clamp(min=1)


def _unwrap(model):
    return getattr(model, "module", model)


def sampled_logprobs(model, batch: dict, params: SamplingParams, chunk: int = 4096, replay: bool = False):
    """(logprob [B, T], entropy [B, T], model output) of the target tokens under `params`' sampling
    distribution; 0 where there is no target. `replay`: route every token to the experts the engine
    recorded for it (router replay), where the batch carries them.

    The LM head is read only inside the model's forward (the fused kernel and the rebuild of missing
    supports both run there), where ZeRO-3 has gathered it."""
    sel = batch["targets"] >= 0
    support = None
    if not params.is_full_distribution:
        support = functools.partial(kept_support, batch, sel, params=params, chunk=chunk)
    routes = batch.get("routes") if replay else None
    temperature = params.temperature if params.temperature > 0 else 1.0
    if "lengths" not in batch or not getattr(_unwrap(model), "packs_documents", False):
        out = model(batch["input_ids"], targets=batch["targets"], temperature=temperature, routes=routes, kept_support=support)
        return out.logprobs, out.entropy, out
    # the rows' real tokens back to back in one row for the forward (Repacked keeps their order, so
    # the kept supports, selected row-major, still line up), the outputs read back in the batch's layout
    pack = Repacked.of(batch["lengths"], batch["input_ids"].shape[1])
    out = model(
        pack.pack(batch["input_ids"]),
        targets=pack.pack(batch["targets"]),
        segment_ids=pack.segment_ids,
        position_ids=pack.position_ids,
        temperature=temperature,
        routes=pack.pack(routes) if routes is not None else None,
        kept_support=support,
    )
    out.logprobs, out.entropy = pack.unpack(out.logprobs, 0.0), pack.unpack(out.entropy, 0.0)
    if out.routes is not None:
        out.routes = pack.unpack(out.routes, -1)
    return out.logprobs, out.entropy, out


def kept_support(batch: dict, sel: torch.Tensor, h: torch.Tensor, head: torch.Tensor, *, params: SamplingParams, chunk: int):
    """int64 [N, K] kept ids of the N target tokens (`sel`, hidden states `h`): the engine's where it
    recorded them, rebuilt from the trainer's own logits (fp32, `chunk` rows at a time) where it did
    not. Called by the model's forward, which holds the LM head `head`."""
    targets = batch["targets"][sel]
    recorded = batch.get("support")
    if recorded is not None and recorded.shape[-1]:
        support = recorded.to(h.device)[sel]
    else:
        support = torch.full((len(targets), 0), -1, dtype=torch.long, device=h.device)
    unknown = (support < 0).all(dim=1).nonzero()[:, 0]
    if len(unknown):
        hu = h[unknown]
        parts = [
            support_ids(torch.nn.functional.linear(hu[i : i + chunk].float(), head.float()), params)
            for i in range(0, len(hu), chunk)
        ]
        width = max([support.shape[1], *(p.shape[1] for p in parts)])
        support = torch.nn.functional.pad(support, (0, width - support.shape[1]), value=-1)
        support[unknown] = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])
    # The sampled token was in the engine's support. A rebuilt support computed in another precision
    # (bf16 trainer vs engine) can lose a boundary token: keep it in, so its logprob stays finite and
    # the difference shows up as mismatch for TIS, not as -inf / NaN.
    missing = ~(support == targets[:, None]).any(dim=1)
    return torch.cat([support, torch.where(missing, targets, -1)[:, None]], dim=1)


def policy_mask(batch: dict) -> torch.Tensor:
    """The loss mask on the policy's own rows (the teacher's rows zeroed)."""
    if "teacher_rows" not in batch:
        return batch["mask"]
    return batch["mask"] * (1 - batch["teacher_rows"].to(batch["mask"]))[:, None]


def teacher_stats(logp_old: torch.Tensor, batch: dict, tis_cap: float | None) -> dict[str, torch.Tensor]:
    """`teacher/*` of the teacher's rows: the log-ratio log π_old - log π_teacher (mean |.|, the ratio's
    p50) and the share of their tokens whose importance weight the TIS cap truncates (NaN without
    teacher tokens: every trainer rank reports the same keys)."""
    mask = batch["mask"] * batch["teacher_rows"].to(batch["mask"])[:, None]
    s = mismatch_stats(logp_old.cpu(), batch["rollout_logprobs"].cpu(), mask.cpu(), tis_cap)
    out = {f"teacher/{k}": torch.tensor(float(s[k])) for k in ("mean_abs_dlogp", "ratio_p50", "tis_clip_frac")}
    # what they are means over (the policy's: mismatch/tokens), their weight when merged over trainer ranks
    out["teacher/trained_tokens"] = torch.tensor(float(s["tokens"]))
    return out


def support_rebuilt_frac(batch: dict) -> float:
    """Share of the policy's trained tokens whose kept support the engine did not record."""
    sel = policy_mask(batch) > 0
    recorded = batch.get("support")
    if recorded is None or not recorded.shape[-1] or not sel.any():
        return float(sel.any())
    return float((recorded[sel] < 0).all(dim=1).float().mean())


def make_loss_fn(params: SamplingParams, loss_cfg: PolicyLossConfig, ref_model=None, replay: bool = False, teacher: bool = False):
    """loss_fn(model, batch, n_tokens, n_micro) for `stages.train` backends: the TIS policy loss
    (+ router losses); its stats include the engine-vs-trainer mismatch of this very batch.
    `replay`: router replay (see `sampled_logprobs`). `teacher`: the batches carry teacher rows
    (`teacher/*` statistics every step)."""

    def loss_fn(model, batch, _n_tokens, num_micro):
        cfg = _unwrap(model).config
        logp, ent, out = sampled_logprobs(model, batch, params, replay=replay)
        mask = batch["mask"]
        logp_ref = None
        if loss_cfg.kl_coef:
            with torch.no_grad():
                logp_ref, _, _ = sampled_logprobs(ref_model, batch, params, replay=replay)
        # logp_old: the trainer's recomputation under the behaviour weights (step k - lag), given
        # by the caller when they differ from the current ones. exp(logp - logp_old) carries the
        # staleness (PPO-clipped if configured); the TIS weight exp(logp_old - logp_rollout) only
        # the engine-vs-trainer difference, which is what `mismatch` reports: same weights, two
        # implementations.
        logp_old = batch["logp_old"] if "logp_old" in batch else logp.detach()
        loss, stats = policy_loss(
            logp, logp_old, batch["rollout_logprobs"], batch["advantages"], mask, loss_cfg, logp_ref=logp_ref, entropy=ent
        )
        # policy_share: this trainer rank's share of the batch's loss normaliser (stages.rlcore.trainer)
        loss = loss * batch.get("policy_share", 1.0) / num_micro
        loss = loss + (cfg.router_aux_loss_coef * out.aux_loss + cfg.router_z_loss_coef * out.z_loss) / num_micro
        # (on the CPU: mismatch_stats builds its quantile points there)
        # engine vs trainer and staleness: the policy's own rows (the teacher's ratio is not a mismatch)
        own = policy_mask(batch)
        mism = mismatch_stats(logp_old.cpu(), batch["rollout_logprobs"].cpu(), own.cpu(), loss_cfg.tis_cap)
        tokens = mask.sum()
        res = {f"loss/{k}": torch.tensor(float(v)) for k, v in stats.items()}
        res |= {f"mismatch/{k}": torch.tensor(float(v)) for k, v in mism.items()}
        res["staleness/mean_abs_dlogp"] = masked_mean((logp.detach() - logp_old).abs(), own)
        if teacher:
            res |= teacher_stats(logp_old, batch, loss_cfg.tis_cap)
        if not params.is_full_distribution:
            res["mismatch/support_rebuilt_frac"] = torch.tensor(support_rebuilt_frac(batch))
        if "routes" in batch and out.routes is not None:  # measured with and without replay
            res["mismatch/route_agreement"] = route_agreement(out.routes, batch["routes"]).detach().float()
        res |= {
            "tokens": tokens.detach(),
            "entropy_sum": (ent * mask).sum().detach(),
            "router": {k: v for k, v in out.router_stats.items() if k != "expert_load"},
            "input_tokens": torch.tensor(float(batch["input_ids"].numel())),
        }
        return loss, res

    return loss_fn
