"""The trainer role: resume, receive batch k, update, publish weights k+1, log, checkpoint, evaluate."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text
from snowcat.pipeline.history import History
from snowcat.pipeline.retention import Retention, RetentionPolicy
from snowcat.stages.agent import STATUSES
from snowcat.stages.algorithms import PolicyLossConfig
from snowcat.stages.model import load_model_dir, save_model_dir
from snowcat.stages.rlcore.trainer import make_batch, make_loss_fn, sampled_logprobs
from snowcat.stages.rlcore.transport import TransportError
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.train import OptimConfig, latest_checkpoint, load_checkpoint, make_backend, save_checkpoint
from snowcat.stages.train.backend import local_device
from snowcat.stages.verifiers import load_verifier


def batch_metrics(trajs) -> dict[str, float]:
    """Reward by domain, pass rate, lengths, turns, statuses of one batch."""
    rec: dict[str, float] = {}
    by_dom = defaultdict(list)
    for t in trajs:
        by_dom[t.domain].append(t)
    ok = [t for t in trajs if t.trainable]
    rec["reward/mean"] = float(np.mean([t.reward for t in ok])) if ok else float("nan")
    rec["pass_rate"] = float(np.mean([t.reward >= 1.0 for t in ok])) if ok else float("nan")
    for d, ts in sorted(by_dom.items()):
        good = [t for t in ts if t.trainable]
        if good:
            rec[f"reward/{d}"] = float(np.mean([t.reward for t in good]))
    rec["length/response_mean"] = float(np.mean([int(t.loss_mask.sum()) for t in trajs]))
    rec["length/total_mean"] = float(np.mean([len(t) for t in trajs]))
    rec["turns/mean"] = float(np.mean([len(t.turn_boundaries) for t in trajs]))
    counts = Counter(t.status for t in trajs)

    for s in STATUSES:
        rec[f"status/{s}"] = counts.get(s, 0) / len(trajs)
    # groups whose attempts all agree carry no signal for binary rewards
    groups = defaultdict(list)
    for t in ok:
        groups[t.group_id].append(t.reward)
    rec["groups/no_signal_frac"] = float(np.mean([len(set(r)) <= 1 for r in groups.values()])) if groups else 1.0
    rec["policy_lag/mean"] = float("nan")
    return rec


def quick_eval(model, tok, tasks, params, attempts: int, seed: int, verify, batch: int = 128) -> dict[str, float]:
    """Sampled pass rate on held-out tasks (same seeds every time: common random numbers).
    Verifier failures are infrastructure: left out, never counted as fails."""

    engine = TorchEngine(model, max_batch=batch)
    reqs = [t for t in tasks for _ in range(attempts)]
    prompts = [tok.render_prompt(t.messages(with_answer=False)) for t in reqs]
    outs = engine.generate(prompts, params, seed=seed)
    model.train()
    per: dict[str, list[float]] = defaultdict(list)
    for t, c in zip(reqs, outs):
        ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        try:
            per[t.domain].append(float(verify(t, tok.decode(ids, skip_special_tokens=True)).passed))
        except Exception:  # noqa: BLE001 - a verifier crash is infrastructure, not a model failure
            continue
    res = {f"val/pass@1/{d}": float(np.mean(v)) for d, v in sorted(per.items())}
    res["val/pass@1"] = float(np.mean([x for v in per.values() for x in v])) if per else float("nan")
    return res


class Trainer:
    def __init__(self, ctx, cfg, pool, held_out, handoff, transport, comm=None):
        self.ctx, self.cfg, self.pool, self.held_out = ctx, cfg, pool, held_out
        self.handoff, self.transport, self.comm = handoff, transport, comm
        self.out = Path(ctx.out_dir)
        self.ckpts = self.out / "checkpoints"
        self.init_path = ctx.checkpoint(cfg.init_from, "init_from")

        self.device = local_device(ctx.local_rank)
        resume = latest_checkpoint(self.ckpts)
        self.model, _, self.tok = load_model_dir(resume or self.init_path, device=self.device)
        if self.tok is None:
            raise UserError(f"{self.init_path}: checkpoint has no tokenizer.json")
        if resume is None and not (self.ckpts / "initial").is_dir():
            save_model_dir(self.ckpts / "initial", self.model, self.tok, meta={"stage": ctx.name, "step": 0})
        self.params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (self.tok.end_of_turn_id,))
        optim = OptimConfig(
            lr=cfg.lr,
            min_lr_ratio=1.0,
            warmup_steps=cfg.warmup_steps,
            total_steps=cfg.updates,
            schedule="constant",
            weight_decay=cfg.weight_decay,
            grad_clip=cfg.grad_clip,
        )
        self.backend = make_backend("torch", self.model, optim)
        self.loss_cfg = PolicyLossConfig(
            aggregation=cfg.aggregation,
            clip_low=cfg.ppo_clip,
            tis_cap=cfg.tis_cap,
            length_const=float(cfg.max_total_tokens),
            kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef,
        )
        self.verify = load_verifier(cfg.verifier, "rl.verifier")
        self.behaviour = None  # the weights that generated the current batch, when lag > 0
        self.ref_model = None
        if cfg.kl_coef:
            self.ref_model = load_model_dir(self.init_path, device=self.device)[0].eval().requires_grad_(False)
        self.retention = Retention(
            self.ckpts,
            RetentionPolicy(metric="val/pass@1", mode="max", keep_best=cfg.keep_best, keep_last=cfg.keep_last),
            name="step_{step:06d}",
        )
        self.history_h5 = History(ctx.run_dir)
        self.history_path = self.out / "metrics_history.jsonl"
        self.history: list[dict] = []
        self.last_ckpt = 0
        self.eval_cache: dict = {}  # the latest quick eval (the retention metric of the next checkpoint)
        if resume is not None:
            client = load_checkpoint(resume, self.backend)
            self.last_ckpt = int(client["step"])
            self.eval_cache = client.get("last_eval", {})
            if self.history_path.is_file():  # lines after the checkpoint belong to a lost future
                self.history = [
                    h for h in map(json.loads, self.history_path.read_text().splitlines()) if h["step"] <= self.backend.step
                ]

    @property
    def step(self) -> int:
        return self.backend.step

    def save(self, metrics: dict | None = None) -> None:
        if self.last_ckpt == self.step and self.retention.path(self.step).is_dir():
            return  # already saved at this step (keep its registered metric)
        client = {
            "policy_version": self.step,
            "next_batch": self.step,
            "lag": self.cfg.lag,
            "data_order": "pure function of (seed, batch index)",
            "last_eval": self.eval_cache,
            "handoff_versions": self.handoff.versions(),
        }
        save_checkpoint(
            self.retention.path(self.step),
            self.backend,
            self.tok,
            client,
            meta={"stage": self.ctx.name, "seed": self.ctx.seed, "policy_version": self.step},
        )
        self.retention.register(self.step, metrics or {})
        self.last_ckpt = self.step
        # nothing before the checkpoint can be needed again, even by a resumed run
        self.handoff.prune(below=max(0, self.last_ckpt - self.cfg.lag))
        if hasattr(self.transport, "discard_below"):
            self.transport.discard_below(self.last_ckpt)

    def evaluate(self) -> dict:
        if not self.held_out or not self.cfg.eval_tasks:
            return {}
        self.eval_cache = quick_eval(
            self.model, self.tok, self.held_out, self.params, self.cfg.eval_attempts, seed=self.ctx.seed + 101, verify=self.verify
        )
        return self.eval_cache

    def _add_behaviour_logprobs(self, batch: dict, versions: set[int]) -> None:
        """logp_old under the weights that generated the batch, when they are not the current ones
        (lag > 0): loaded from the handoff, verified, like any rollout rank loads them."""

        (version,) = versions  # batch k is generated by exactly one version, k - lag
        if version == self.step:
            return
        if self.behaviour is None:
            self.behaviour = load_model_dir(self.init_path, device=self.device)[0].requires_grad_(False)
            self.behaviour_version = None
        if self.behaviour_version != version:
            self.handoff.load_into(self.behaviour, version, timeout_s=self.cfg.timeout_s)
            self.behaviour_version = version
        with torch.no_grad():
            on_device = {k: v.to(self.device) for k, v in batch.items()}
            batch["logp_old"], _, _ = sampled_logprobs(self.behaviour, on_device, self.params)

    def _log(self, log, rec: dict) -> None:
        self.history.append(rec)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        self.history_h5.append(self.ctx.name, rec["step"], {k: v for k, v in rec.items() if k != "step"})

    def train(self, local_rollout=None) -> dict:
        cfg, ctx = self.cfg, self.ctx
        # Repair the handoff: drop torn/unstable versions and any "future" beyond the resumed step,
        # then (re)publish the current version so rollout ranks can start.
        self.handoff.clean(keep_upto=self.step)
        self.handoff.publish(self.step, self.model)
        if self.comm is not None:
            self.comm.bcast(self.step, root=0)
        atomic_write_text(self.history_path, "".join(json.dumps(h) + "\n" for h in self.history))
        loss_fn = make_loss_fn(self.params, self.loss_cfg, self.ref_model)
        t_start, wait_total, tokens_total = time.perf_counter(), 0.0, 0
        log = self.history_path.open("a")
        try:
            if self.step == 0 and cfg.eval_every and not self.history:  # the init's score: row 0
                self._log(log, {"step": 0, **self.evaluate()})
            while self.step < cfg.updates:
                if ctx.checkpoint_due():
                    self.save()
                    raise ctx.Preempted(f"rl: checkpointed at step {self.step}")
                k = self.step  # batch k feeds update k+1
                t0 = time.perf_counter()
                if local_rollout is not None and not self.transport.has(k):
                    local_rollout.produce(k)
                t1 = time.perf_counter()
                try:
                    trajs = self.transport.recv_batch(k)
                except TransportError:
                    if not ctx.checkpoint_due():
                        raise
                    self.save()  # the wait was cut short by a preemption notice
                    raise ctx.Preempted(f"rl: checkpointed at step {self.step} while waiting for batch {k}") from None
                wait = time.perf_counter() - t1
                batch = make_batch(trajs, self.tok.pad_id, cfg.estimator)
                self._add_behaviour_logprobs(batch, {t.policy_version for t in trajs})
                s = self.backend.train_step([batch], loss_fn)
                self.handoff.publish(self.step, self.model)
                step_time = time.perf_counter() - t0
                wait_total += wait
                rec = {"step": self.step, **batch_metrics(trajs)}
                rec["policy_lag/mean"] = float(np.mean([k - t.policy_version for t in trajs]))
                rec.update({k2: float(v) for k2, v in s.items() if not isinstance(v, dict)})
                rec.update({f"router/{k2}": float(v) for k2, v in s.get("router", {}).items()})
                sampled = int(sum(int(t.loss_mask.sum()) for t in trajs))
                tokens_total += sampled
                rec.update(
                    {
                        "time/step_s": step_time,
                        "time/wait_batch_s": wait,
                        "throughput/sampled_tokens_per_s": sampled / max(step_time, 1e-9),
                    }
                )
                evaluated = cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.updates)
                if evaluated:
                    rec.update(self.evaluate())
                self._log(log, rec)
                ctx.progress(
                    self.step,
                    cfg.updates,
                    unit="updates",
                    reward=rec["reward/mean"],
                    **({"val pass@1": rec["val/pass@1"]} if "val/pass@1" in rec else {}),
                    **{"tok/s": rec["throughput/sampled_tokens_per_s"]},
                )
                if self.step == cfg.updates or (cfg.save_every and self.step % cfg.save_every == 0) or evaluated:
                    self.save(rec if evaluated else None)
        finally:
            log.close()
        train_s = time.perf_counter() - t_start

        if self.last_ckpt != self.step:
            self.save()
        save_model_dir(self.ckpts / "final", self.model, self.tok, meta={"stage": ctx.name, "seed": ctx.seed, "step": self.step})
        best = self.retention.best()
        atomic_write_text(self.ckpts / "best", (self.retention.path(best).name if best is not None else "final") + "\n")
        last = self.history[-1] if self.history else {}
        metrics = {
            "updates": self.step,
            "train_seconds": round(train_s, 2),
            "wait_seconds": round(wait_total, 2),
            "sampled_tokens_per_s": round(tokens_total / max(train_s, 1e-9), 1),
            "best_step": best,
            **{k: v for k, v in self.eval_cache.items()},
            **{f"initial_{k}": v for k, v in (self.history[0] if self.history else {}).items() if k.startswith("val/")},
            "final_reward_mean": last.get("reward/mean"),
        }
        atomic_write_json(self.out / "metrics.json", metrics)
        return metrics
