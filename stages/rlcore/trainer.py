"""The trainer role: resume, receive batch k, update, publish weights k+1, log, checkpoint, evaluate.

With T trainer ranks (data parallel, one torch process group): rank 0 receives batch k and
passes its message on as it is (`transport.broadcast_message`); every rank computes the advantages on the whole batch
and trains on its contiguous slice of rows, its loss weighted by its share of the batch's
normaliser, so that DDP's mean over ranks is the loss of the whole batch. Rank 0 alone publishes
weights, writes metrics, history, progress and the retention ledger, and runs the quick eval;
checkpoints are collective (`stages.train.checkpoint`)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, read_json
from snowcat.pipeline.retention import RetentionPolicy
from snowcat.stages.agent import STATUSES, BatchBuffers, make_env
from snowcat.stages.agent.context import context_behaviour, is_failure
from snowcat.stages.agent.dataset import DIRNAME, TrajectoryWriter
from snowcat.stages.agent.prompting import PromptError, PromptStripper
from snowcat.stages.agent.trajectory import segments
from snowcat.stages.algorithms import PolicyLossConfig
from snowcat.stages.config import env_options, keep_trajectories
from snowcat.stages.evalstats import mean_se
from snowcat.stages.model.io import copy_model_dir, empty_model
from snowcat.stages.rlcore.handoff import HandoffError
from snowcat.stages.rlcore.objective import make_batch, make_loss_fn, sampled_logprobs, update_rows
from snowcat.stages.rlcore.preempt import FAILED, log
from snowcat.stages.rlcore.transport import TransportError, broadcast_message, read_batch
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.scoring import pass_rates, sample_attempts
from snowcat.stages.taskgen import selection_split
from snowcat.stages.train import OptimConfig, StepStats, latest_checkpoint, load_for_training, with_whole_tensors
from snowcat.stages.train.backend import is_fsdp_module, load_rows, local_device
from snowcat.stages.train.loop import Checkpoints, MetricsLog, TrainLoop
from snowcat.stages.train.precision import resolve, stored_dtype, unchanged_fraction
from snowcat.stages.verifiers import load_verifier


def batch_metrics(trajs, summarised: bool = False) -> dict[str, float]:
    """Reward by domain, pass rate, lengths, turns, statuses of the policy's own episodes; the share of
    groups without signal and the episodes that entered the loss count every episode trained on (the
    teacher's included); the teacher's episodes apart (`teacher_metrics`). `trajs` are episodes (each
    its last record, the earlier ones in `earlier`): a summarised episode counts once, its lengths
    and turns summed over its records; `summarised` (rl.context summarise): `context_metrics` too."""
    teacher = [t for t in trajs if t.source == "teacher"]
    rec = _policy_metrics([t for t in trajs if t.source != "teacher"])
    for d, n in Counter(t.domain for t in teacher if t.trainable).items():
        rec[f"exposure/{d}"] = rec.get(f"exposure/{d}", 0) + n
    rec["groups/no_signal_frac"] = _no_signal_frac([t for t in trajs if t.trainable])
    if teacher:
        rec |= teacher_metrics(trajs)
    if summarised:
        rec |= context_metrics(trajs)
    return rec


def sampled_tokens(t) -> int:
    """Tokens the model sampled in episode `t`, over all its records (summaries the policy wrote included)."""
    return sum(int(r.loss_mask.sum()) for r in segments(t))


def context_metrics(trajs) -> dict[str, float]:
    """What the context policy did to the policy's episodes of a batch (stages/agent/context.py):
    summaries per episode and the share summarised, over the scored ones; `context/summary_failures`
    counts the episodes whose summary could not be written (infra: out of the pass rate and the loss)."""
    own = [t for t in trajs if t.source != "teacher"]
    stats = context_behaviour(own)
    return {
        "context/summaries_per_episode": stats["summaries_per_episode"],
        "context/summarised_frac": stats["summarised_frac"],
        "context/summary_failures": float(sum(t.status == "infra_error" and is_failure(t.detail) for t in own)),
    }


def _no_signal_frac(ok) -> float:
    """Share of groups whose attempts all agree: no signal for binary rewards."""
    groups = defaultdict(list)
    for t in ok:
        groups[t.group_id].append(t.reward)
    return float(np.mean([len(set(r)) <= 1 for r in groups.values()])) if groups else 1.0


def teacher_metrics(trajs) -> dict[str, float]:
    """The teacher's episodes of a batch: reward, pass rate, sampled tokens, and the share of groups
    (tasks) that only the teacher passed, where its episodes are the whole signal."""
    teacher = [t for t in trajs if t.source == "teacher" and t.trainable]
    passed: dict[int, set[str]] = defaultdict(set)
    for t in trajs:
        if t.trainable and t.passed:
            passed[t.group_id].add(t.source)
    groups = {t.group_id for t in trajs}
    return {
        "teacher/episodes": float(sum(t.source == "teacher" for t in trajs)),
        # counts, so that a run's pass rate is a ratio of sums (the card's), not a mean of rates
        "teacher/passed": float(sum(t.passed for t in teacher)),
        "teacher/infra_failures": float(sum(t.source == "teacher" and not t.trainable for t in trajs)),
        "teacher/reward_mean": float(np.mean([t.reward for t in teacher])) if teacher else float("nan"),
        "teacher/pass_rate": float(np.mean([t.passed for t in teacher])) if teacher else float("nan"),
        "teacher/tokens": float(sum(sampled_tokens(t) for t in trajs if t.source == "teacher")),
        "teacher/only_teacher_passed_frac": sum(passed[g] == {"teacher"} for g in groups) / len(groups),
    }


def _policy_metrics(trajs) -> dict[str, float]:
    rec: dict[str, float] = {}
    by_dom = defaultdict(list)
    for t in trajs:
        by_dom[t.domain].append(t)
    ok = [t for t in trajs if t.trainable]
    rec["reward/mean"] = float(np.mean([t.reward for t in ok])) if ok else float("nan")
    rec["pass_rate"] = float(np.mean([t.passed for t in ok])) if ok else float("nan")
    for d, ts in sorted(by_dom.items()):
        good = [t for t in ts if t.trainable]
        rec[f"exposure/{d}"] = len(good)  # trajectories of the domain that entered this update's loss
        if good:
            rec[f"reward/{d}"] = float(np.mean([t.reward for t in good]))
    # per episode: over all its records (a summarised episode's contexts and the summaries it wrote)
    rec["length/response_mean"] = float(np.mean([sampled_tokens(t) for t in trajs]))
    rec["length/total_mean"] = float(np.mean([sum(len(r) for r in segments(t)) for t in trajs]))
    turns = [sum(len(r.turn_boundaries) for r in segments(t) if r.segment_kind == "context") for t in trajs]
    rec["turns/mean"] = float(np.mean(turns))
    counts = Counter(t.status for t in trajs)

    for s in STATUSES:
        rec[f"status/{s}"] = counts.get(s, 0) / len(trajs)
    rec["policy_lag/mean"] = float("nan")
    return rec


def quick_eval(model, tok, tasks, params, attempts: int, seed: int, verify, split: str, batch: int = 128) -> dict[str, float]:
    """Sampled pass rate on held-out tasks of `split` (same seeds every time: common random numbers)."""
    engine = TorchEngine(model, max_batch=batch)
    scored = sample_attempts(engine, tok, tasks, params, attempts=attempts, seed=seed, verifier=verify, batch_size=batch)
    rates = pass_rates(scored)
    per_task: dict[str, list[bool]] = defaultdict(list)
    for a in scored:
        if a.scored:
            per_task[a.task.task_id].append(a.passed)
    # checkpoints are selected by this value: its SE over tasks says how much that choice can be trusted
    _, se = mean_se([float(np.mean(v)) for v in per_task.values()])
    model.train()
    return {(f"{split}/pass@1" if d == "all" else f"{split}/pass@1/{d}"): v for d, v in rates.items()} | {
        f"{split}/pass@1_se": se,
        f"{split}/tasks": len(per_task),
    }


def engine_counters(out: Path) -> dict[str, float]:
    """The rollout ranks' engine counters (vLLM weight reloads, reload checks, rebuilds, seconds),
    summed over ranks: each rank rewrites its engine_rank<r>.json after every weight load, before it
    generates the batch that the trainer is receiving."""
    total: dict[str, float] = {}
    for path in sorted(out.glob("engine_rank*.json")):
        for key, value in (read_json(path) or {}).items():
            if key != "version":
                total[f"engine/{key}"] = total.get(f"engine/{key}", 0.0) + float(value)
    return total


def episode_turns(records) -> list[int | None]:
    """Per record (`update_rows` order), the episode's number of its first turn: the turns sampled in
    the episode's earlier contexts come first (a summarised episode's turns are spread over its
    records); None for a summary the policy wrote, which is no turn."""
    out, before = [], 0
    for r in records:
        before = 0 if r.segment == 0 else before
        out.append(None if r.segment_kind == "summary" else before)
        before += len(r.turn_boundaries) if r.segment_kind == "context" else 0
    return out


def prompt_gap_sums(
    trajs, prompted: dict, update: dict, with_prompt, without, turns: int, first_turns: list[int | None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The sums `Trainer._prompt_gap` reports, over the rows of `trajs` (as sampled, prompted):
    [gap sum of turn 1..turns, tokens of turn 1..turns, engine |dlogp| sum, engine k3 sum, tokens, gap
    sum of the summaries the policy wrote] and [engine max |dlogp|]. `prompted` / `update` are
    `make_batch` of the trajectories with and without the prompt, `with_prompt` / `without` their
    actions' logprobs [rows, L-1]: row b's trained tokens are the same actions in the same order in
    both (the prompt precedes them all). `first_turns` (`episode_turns`; default: every row's first
    turn is its episode's first) numbers the turns of a summarised episode's records; a summary's gap
    counts in the mean under no turn. The teacher's rows are left out: the gap and the engine's
    mismatch are the policy's."""
    sums, peak = np.zeros(2 * turns + 4), np.zeros(1)
    for b, t in enumerate(trajs):
        if t.source == "teacher":
            continue
        mp, mu = prompted["mask"][b] > 0, update["mask"][b] > 0
        if int(mp.sum()) != int(mu.sum()):
            raise ValueError(
                f"trajectory {t.task_id}/{t.attempt}: {int(mp.sum())} actions sampled, {int(mu.sum())} in the update"
            )
        ours = with_prompt[b][mp].double()
        gap = (ours - without[b][mu].double()).numpy()
        first = 0 if first_turns is None else first_turns[b]
        if first is None:  # a summary the policy wrote
            sums[2 * turns + 3] += gap.sum()
        else:
            starts = [s for s, _ in t.turn_boundaries]
            turn = first + np.searchsorted(starts, mp.nonzero()[:, 0].numpy() + 1, side="right") - 1  # target p: token p + 1
            np.add.at(sums, turn, gap)
            np.add.at(sums, turns + turn, 1.0)
        delta = (ours - prompted["rollout_logprobs"][b][mp].double()).numpy()
        sums[2 * turns : 2 * turns + 3] += [np.abs(delta).sum(), (np.exp(delta) - delta - 1).sum(), len(delta)]
        peak[0] = max(peak[0], float(np.abs(delta).max(initial=0.0)))
    return sums, peak


class Trainer(TrainLoop):
    """Update k+1 trains on batch k (generated by weights k - lag), then publishes weights k+1."""

    unit = "updates"

    def __init__(self, ctx, cfg, held_out, handoff, transport, comm=None, group=None):
        self.cfg, self.held_out = cfg, held_out
        self.handoff, self.transport, self.comm = handoff, transport, comm
        self.group = group  # the trainer ranks' MPI communicator (None: one trainer rank)
        self._broadcast_buffers = BatchBuffers()  # trainer ranks 1..T-1: where rank 0's batches land
        self.local_rollout = None  # a `Rollout` producing batches in this process (world size 1)
        self.control = None  # trainer rank 0 of a multi-rank run: `preempt.TrainerControl`, the other ranks' way out
        self.peer = None  # trainer ranks 1..T-1: `preempt.RolloutControl` (role trainer), rank 0's words
        self.out = Path(ctx.out_dir)
        ckpts = self.out / "checkpoints"
        self.init_path = ctx.checkpoint(cfg.init_from, "init_from")

        self.device = local_device(ctx.local_rank)
        self.lead = ctx.rank == 0  # trainer rank 0 is world rank 0
        resume = latest_checkpoint(ckpts)
        optim = OptimConfig(
            lr=cfg.lr,
            min_lr_ratio=1.0,
            warmup_steps=cfg.warmup_steps,
            total_steps=cfg.updates,
            schedule="constant",
            weight_decay=cfg.weight_decay,
            grad_clip=cfg.grad_clip,
        )
        # `storage_dtype: auto` follows the init checkpoint (bf16 from the hub stays bf16), resumed or not
        precision = resolve(cfg, self.device, stored_dtype(self.init_path), f"stages.{ctx.name}")
        backend, self.tok = load_for_training(
            resume or self.init_path,
            cfg.backend,
            optim,
            device=self.device,
            precision=precision,
            activation_checkpointing=cfg.activation_checkpointing,
            zero_stage=cfg.zero_stage,
            expert_parallel=cfg.expert_parallel,
            **(
                {"tensor_parallel": cfg.tensor_parallel, "pipeline_parallel": cfg.pipeline_parallel}
                if cfg.backend == "megatron"
                else {}
            ),
        )
        self.model = backend.model
        # trainer ranks holding the same rows (megatron's tensor- and pipeline-parallel ranks): their
        # numbers are one replica's, counted once when summed over the trainer ranks
        self.replicas = (self.group.Get_size() if self.group is not None else 1) // backend.data_ranks
        if self.tok is None:
            raise UserError(f"{self.init_path}: checkpoint has no tokenizer.json")
        if self.lead and resume is None and not (ckpts / "initial").is_dir():
            copy_model_dir(self.init_path, ckpts / "initial", self.tok, meta={"stage": ctx.name, "step": 0})
        self.params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (self.tok.end_of_turn_id,))
        loss_cfg = PolicyLossConfig(
            aggregation=cfg.aggregation,
            clip_low=cfg.ppo_clip,
            tis_cap=cfg.tis_cap,
            length_const=float(cfg.max_total_tokens),
            kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef,
        )
        self.verify = load_verifier(cfg.verifier, "rl.verifier")
        self.behaviour = None  # the weights that generated the current batch, when lag > 0
        self.eval_copy = None  # ZeRO-3: rank 0's plain model for the quick eval
        ref_model = None
        if cfg.kl_coef:
            ref_model = backend.frozen_copy(self.init_path)  # sharded as the trained model is
        self.loss_fn = make_loss_fn(self.params, loss_cfg, ref_model, replay=cfg.router_replay, teacher=cfg.teacher_rollouts > 0)
        self.split = selection_split(Path(ctx.inputs[cfg.tasks_input]))  # what checkpoints are selected on
        policy = RetentionPolicy(
            metric=f"{self.split}/pass@1",
            mode="max",
            keep_best=cfg.keep_best,
            keep_last=cfg.keep_last,
            pinned=list(cfg.pin_steps),
        )
        checkpoints = Checkpoints(ckpts, backend, self.tok, policy, meta={"stage": ctx.name, "seed": ctx.seed}, seed=ctx.seed)
        client = checkpoints.restore()
        self.eval_cache: dict = client.get("last_eval", {}) if client else {}  # the retention metric of the next checkpoint
        log = MetricsLog(
            self.out / "metrics_history.jsonl",
            restored_step=backend.step if client else None,
            stage=ctx.name,
            run_dir=ctx.run_dir,
            writer=self.lead,
        )
        super().__init__(ctx, backend, checkpoints, log, steps=cfg.updates, save_every=cfg.save_every, eval_every=cfg.eval_every)
        self.wait_seconds = self.sampled_tokens = 0.0
        self.alarm_said = False  # the mismatch alarm is printed once per process
        # rank 0 keeps each received batch as shard step_<k> (docs/analysis.md); a replayed step rewrites it
        keep = keep_trajectories(cfg.keep_trajectories) if self.lead else 0
        self.kept = TrajectoryWriter(self.out / DIRNAME, stage=ctx.name, env=cfg.env, keep=keep, seed=ctx.seed)
        self.tasks: dict = {}  # task id -> Task (rl.run sets it): the kept rows' answer keys and test paths
        self.stripper = None  # rollout_prompt: removes the prompt's ids from each trajectory (made on first use)
        self._gap: dict = {}  # rollout_prompt: this step's prompted-vs-unprompted likelihood gap

    # ---------------------------------------------------------------- TrainLoop parts

    def client_state(self) -> dict:
        return {
            "policy_version": self.step,
            "next_batch": self.step,
            "lag": self.cfg.lag,
            "data_order": "pure function of (seed, batch index)",
            "last_eval": self.eval_cache,
            # not the handoff versions on disk: they depend on where earlier attempts stopped, and a
            # resumed run's checkpoint must equal an uninterrupted one's (resume needs only the step)
        }

    def save(self, rec: dict | None = None) -> bool:
        saved = super().save(rec)
        if saved and self.lead:  # nothing before the checkpoint can be needed again, even by a resumed run
            self.handoff.prune(below=max(0, self.step - self.cfg.lag))
            if hasattr(self.transport, "discard_below"):
                self.transport.discard_below(self.step)
        return saved

    def next_batch(self, k: int) -> list[dict]:
        self._t0 = time.perf_counter()
        if self.local_rollout is not None and not self.transport.has(k):
            self.local_rollout.produce(k)
        t1 = time.perf_counter()
        self.trajs = self._receive(k)
        if self.trajs is None:  # the wait was cut short by a preemption notice (on every trainer rank)
            self.save()
            raise self.ctx.Preempted(f"rl: checkpointed at step {self.step} while waiting for batch {k}")
        self._wait = time.perf_counter() - t1
        self.kept.write(f"step_{k:06d}", self.trajs, self.tok, step=k, tasks=self.tasks)  # as sampled (prompted)
        update = self._update_context(self.trajs)
        batch = self._own_rows(make_batch(update, self.tok.pad_id, self.cfg.estimator))
        self._add_behaviour_logprobs(batch, {t.policy_version for t in self.trajs})
        self._gap = self._prompt_gap(batch) if self.cfg.rollout_prompt else {}
        return [batch]

    # ---------------------------------------------------------------- prompted rollouts, unprompted updates

    def _update_context(self, trajs: list) -> list:
        """The trajectories the update is computed on: as sampled, or with `rollout_prompt`'s ids
        removed (stages/agent/prompting.py; token-exact, checked per trajectory)."""
        if not self.cfg.rollout_prompt:
            return trajs
        if self.stripper is None:
            env = make_env(self.cfg.env, self.tok, **env_options(self.cfg.env, self.cfg))
            self.stripper = PromptStripper(env, self.cfg.rollout_prompt, self.tasks)
        try:
            return self.stripper(trajs)
        except PromptError as e:
            raise UserError(f"stages.{self.ctx.name}.rollout_prompt: {e}") from None

    def _prompt_gap(self, batch: dict) -> dict[str, float]:
        """Per turn, the mean log-probability of the actions taken with the prompt in context minus
        without it, under the weights that sampled them (`prompt_gap/turn_<t>`, `prompt_gap/mean`);
        and the engine-vs-trainer mismatch in the context the engine sampled in
        (`mismatch_prompted/*`; `mismatch/*` then holds the prompt's effect too, which is what TIS
        corrects). This rank's rows, summed over the trainer ranks (collective)."""
        rows = batch["input_ids"].shape[0]
        records = update_rows(self.trajs)  # the rows: a summarised episode is several
        lo = self.backend.data_rank * len(records) // self.backend.data_ranks
        trajs, first_turns = records[lo : lo + rows], episode_turns(records)[lo : lo + rows]
        prompted = make_batch(trajs, self.tok.pad_id, self.cfg.estimator)
        stale = "logp_old" in batch  # the batch came from older weights: the behaviour copy holds them
        model = self.behaviour if stale else self.model
        with torch.no_grad():
            on_device = {k: v.to(self.device) for k, v in prompted.items()}
            with_prompt = sampled_logprobs(model, on_device, self.params)[0].double().cpu()
            if stale:
                without = batch["logp_old"].double().cpu()
            else:
                without = sampled_logprobs(model, {k: v.to(self.device) for k, v in batch.items()}, self.params)[0]
                without = without.double().cpu()
        turns = self.cfg.max_turns
        sums, peak = prompt_gap_sums(trajs, prompted, batch, with_prompt, without, turns, first_turns)
        sums /= self.replicas
        if self.group is not None:
            from mpi4py import MPI  # noqa: PLC0415

            self.group.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
            self.group.Allreduce(MPI.IN_PLACE, peak, op=MPI.MAX)
        tokens = sums[2 * turns + 2]
        rec = {f"prompt_gap/turn_{i + 1}": sums[i] / sums[turns + i] for i in range(turns) if sums[turns + i]}
        rec["prompt_gap/mean"] = float((sums[:turns].sum() + sums[2 * turns + 3]) / tokens) if tokens else float("nan")
        rec["mismatch_prompted/mean_abs_dlogp"] = float(sums[2 * turns] / tokens) if tokens else float("nan")
        rec["mismatch_prompted/k3_kl"] = float(sums[2 * turns + 1] / tokens) if tokens else float("nan")
        rec["mismatch_prompted/max_abs_dlogp"] = float(peak[0])
        return {k: float(v) for k, v in rec.items()}

    def _receive(self, k: int):
        """Batch k on every trainer rank; None when rank 0's wait was interrupted by a notice."""
        buf = None
        if self.lead:
            try:
                buf = self.transport.recv_message(k)
            except TransportError:
                # a notice (rank 0's view, no collective: the others wait in the broadcast below)
                if not self.transport.should_stop():
                    raise
        if self.group is not None:
            abort = self.peer.trainer_failed if self.peer is not None else None
            # the other ranks wait as long as rank 0 may wait for the batch, and then some
            buf = broadcast_message(
                self.group, buf, timeout_s=2 * self.cfg.timeout_s, abort=abort, buffers=self._broadcast_buffers
            )
        return None if buf is None else read_batch(k, buf, self.transport.source(k))

    def _own_rows(self, batch: dict) -> dict:
        """This trainer rank's contiguous slice of the batch's rows (advantages were computed on all of
        them), and its share of the loss normaliser (`policy_share`): DDP averages the ranks'
        gradients, so a rank's policy loss, a mean over its rows, is weighted by T x (its part of the
        normaliser) / (the batch's). (The router losses weigh their own share: the model's
        balance_router_over.)"""
        rank, n = self.backend.data_rank, self.backend.data_ranks  # the ranks that split the rows
        if n == 1:
            return batch
        rows = batch["input_ids"].shape[0]
        lo, hi = rank * rows // n, (rank + 1) * rows // n
        mask = batch["mask"]
        if self.cfg.aggregation == "token_mean":
            part, whole = mask[lo:hi].sum(), mask.sum()
        elif self.cfg.aggregation == "seq_mean_token_mean":
            part, whole = (mask[lo:hi].sum(dim=-1) > 0).sum(), (mask.sum(dim=-1) > 0).sum()
        else:  # seq_sum_over_const: a constant times the number of rows
            part, whole = hi - lo, rows
        share = n * float(part) / max(float(whole), 1.0)
        return {key: value[lo:hi] for key, value in batch.items()} | {"policy_share": torch.tensor(share)}

    def after_step(self) -> None:
        self._publish()

    def _publish(self) -> None:
        """Collective: weight version `self.step`, written by rank 0 as the weights are gathered."""
        storage = self.backend.precision.storage
        with_whole_tensors(self.backend, lambda tensors: self.handoff.publish(self.step, self.model, self.tok, tensors, storage))

    def record(self, stats: StepStats, batch: list[dict]) -> dict:
        k, trajs = self.step - 1, self.trajs
        stats = self._over_trainer_ranks(stats)
        step_time = time.perf_counter() - self._t0
        sampled = float(sum(sampled_tokens(t) for t in trajs))
        self.wait_seconds += self._wait
        self.sampled_tokens += sampled
        rec = {
            **batch_metrics(trajs, summarised=self.cfg.context.policy == "summarise"),
            "policy_lag/mean": float(np.mean([k - t.policy_version for t in trajs if t.source != "teacher"])),
            **stats.record(),
            **{name: float(v) for name, v in stats.sums.items()},
            "time/step_s": step_time,
            "time/wait_batch_s": self._wait,
            "throughput/sampled_tokens_per_s": sampled / max(step_time, 1e-9),
        }
        rec |= self._gap
        # with a rollout prompt, mismatch/* holds the prompt's effect: the alarm reads the engine's own
        kl_key = "mismatch_prompted/k3_kl" if self.cfg.rollout_prompt else "mismatch/k3_kl"
        rec["alarm/mismatch_kl"] = float(self._mismatch_alarm(rec.get(kl_key, float("nan")), kl_key))
        return rec | engine_counters(self.out)

    def _over_trainer_ranks(self, stats: StepStats) -> StepStats:
        """The step's numbers for the whole batch: token counts summed over the trainer ranks, the
        loss's means weighted by each rank's trained tokens, those of one source's rows by that
        source's (with teacher rows: `mismatch/*` and `staleness/*` by the policy's, `teacher/*` by
        the teacher's; a rank without them adds nothing), quantiles too (an approximation), maxima
        the largest (collective)."""
        if self.group is None:
            return stats
        from mpi4py import MPI  # noqa: PLC0415

        names = sorted(stats.sums)
        values = np.array([float(stats.sums[n]) for n in names])
        weights = np.array([self._merge_weight(stats, n) for n in names])
        counts = np.array([n.endswith("tokens") for n in names])  # mismatch/tokens, teacher/trained_tokens
        tokens = np.array([stats.tokens, stats.input_tokens, stats.tokens * stats.entropy])
        # each a sum over ranks: a count itself, a mean as weight x value (0 where the rank has no weight)
        parts = np.concatenate([tokens, np.where(counts, values, np.where(weights > 0, weights * values, 0.0)), weights])
        parts /= self.replicas
        maxima = values.copy()
        self.group.Allreduce(MPI.IN_PLACE, parts, op=MPI.SUM)
        self.group.Allreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)
        summed, weight = parts[3 : 3 + len(names)], parts[3 + len(names) :]
        merged = {}
        for i, n in enumerate(names):
            if "max" in n:
                merged[n] = maxima[i]
            elif counts[i]:
                merged[n] = summed[i]
            else:
                merged[n] = summed[i] / weight[i] if weight[i] > 0 else float("nan")
        total = max(float(parts[0]), 1.0)
        return dataclasses.replace(
            stats,
            tokens=float(parts[0]),
            input_tokens=float(parts[1]),
            entropy=float(parts[2]) / total,
            sums={n: torch.tensor(v) for n, v in merged.items()},
        )

    @staticmethod
    def _merge_weight(stats: StepStats, name: str) -> float:
        """What a statistic of this rank is a mean over: its source's trained tokens where the batch
        has teacher rows and the statistic is of one source's, else every trained token."""
        if "teacher/trained_tokens" not in stats.sums:
            return stats.tokens
        if name.startswith("teacher/"):
            return float(stats.sums["teacher/trained_tokens"])
        if name.startswith(("mismatch/", "staleness/")):  # the policy's own rows
            return float(stats.sums["mismatch/tokens"])
        return stats.tokens

    def _mismatch_alarm(self, kl: float, key: str = "mismatch/k3_kl") -> bool:
        """On while the engine-vs-trainer k3 KL, averaged over the last `mismatch_kl_window` updates,
        is above `mismatch_kl_alarm`: the rollouts no longer come from the policy being trained."""
        window = self.cfg.mismatch_kl_window
        recent = [r.get(key, float("nan")) for r in self.log.records[-(window - 1) :]] if window > 1 else []
        values = [v for v in [*recent, kl] if v == v]  # NaN: a batch without trained tokens
        on = len(values) >= window and float(np.mean(values)) > self.cfg.mismatch_kl_alarm
        if on and not self.alarm_said and self.lead:
            self.alarm_said = True
            print(
                f"rl: ALARM engine-vs-trainer mismatch: k3 KL {np.mean(values):.4f} over the last {window} updates "
                f"exceeds {self.cfg.mismatch_kl_alarm} (rl.mismatch_kl_alarm); see docs/rollout-engines.md",
                file=sys.stderr,
                flush=True,
            )
        return on

    def evaluate(self) -> dict:
        if not self.held_out or not self.cfg.eval_tasks:
            return {}
        model = self._eval_model()
        if self.lead:  # the others wait at the checkpoint an eval is followed by
            self.eval_cache = quick_eval(
                model,
                self.tok,
                self.held_out,
                self.params,
                self.cfg.eval_attempts,
                seed=self.ctx.seed + 101,
                verify=self.verify,
                split=self.split,
            )
        return self.eval_cache

    def _eval_model(self):
        """What rank 0 samples the quick eval with (None on the other ranks): the trained model, or
        under ZeRO-3 (whose forward gathers parameters together with every rank: rank 0 alone hung;
        FSDP's too) or sharded experts (all-to-alls with the other ranks) a plain copy of its
        weights, filled as they are gathered one at a time (collective then)."""
        if not self.backend.shards_parameters and self.backend.ep is None:
            return self.model if self.lead else None
        if self.lead and self.eval_copy is None:
            self.eval_copy = empty_model(self.model.config, next(self.model.parameters()).dtype, self.device)
        copy = dict(self.eval_copy.state_dict(keep_vars=True)) if self.lead else {}
        with torch.no_grad():
            for name, whole in self.backend.whole_tensors():
                if whole is not None:
                    copy[name].copy_(whole)
        return self.eval_copy

    def progress_numbers(self, rec: dict) -> dict:
        return {
            "reward": rec["reward/mean"],
            **({f"{self.split} pass@1": rec[f"{self.split}/pass@1"]} if f"{self.split}/pass@1" in rec else {}),
            "tok/s": rec["throughput/sampled_tokens_per_s"],
        }

    def _add_behaviour_logprobs(self, batch: dict, versions: set[int]) -> None:
        """logp_old under the weights that generated the batch, when they are not the current ones
        (lag > 0): loaded from the handoff, verified, like any rollout rank loads them (under fsdp
        into a copy sharded as the trained model, verified by rank 0 alone: collective, every
        trainer rank runs it in step)."""

        (version,) = versions  # batch k is generated by exactly one version, k - lag
        if version == self.step:
            return
        if self.behaviour is None:
            self.behaviour = self.backend.frozen_copy()  # sharded as the trained model is
            self.behaviour_version = None
        if self.behaviour_version != version:
            if is_fsdp_module(self.behaviour):  # each rank reads its rows of the verified version
                load_rows(self.behaviour, self._verified_by_lead(version))
            elif self.backend.name == "megatron":  # each rank its slices, through the bridge
                self.backend.load_copy(self.behaviour, self._verified_by_lead(version))
            else:  # whole: hashed as it is read into the model
                self.handoff.load_into(self.behaviour, version, timeout_s=self.cfg.timeout_s)
            self.behaviour_version = version
        if self.backend.name == "megatron":  # through the pipeline: the value lands on the last stage, where the loss is
            logp = self.backend.forward_only(
                self.behaviour, batch, lambda m, b: sampled_logprobs(m, b, self.params, replay=self.cfg.router_replay)[0]
            )
            if logp is not None:
                batch["logp_old"] = logp
            return
        with torch.no_grad():
            on_device = {k: v.to(self.device) for k, v in batch.items()}
            batch["logp_old"], _, _ = sampled_logprobs(self.behaviour, on_device, self.params, replay=self.cfg.router_replay)

    def _verified_by_lead(self, version: int) -> Path:
        """The directory of weight version `version` once trainer rank 0 has verified it (every
        file hashed against the manifest); the other trainer ranks take its word rather than each
        reading the whole model to hash it (at 67B, 134 GB per rank per update). HandoffError on
        every rank where it does not verify. Collective over the trainer ranks."""
        outcome = None
        if self.lead:
            try:
                outcome = (True, str(self.handoff.wait_verified(version, timeout_s=self.cfg.timeout_s)))
            except HandoffError as e:
                outcome = (False, str(e))
        if self.group is not None:
            outcome = self.group.bcast(outcome, root=0)
        verified, said = outcome
        if not verified:
            raise HandoffError(said)
        return Path(said)

    # ---------------------------------------------------------------- the role

    def run(self) -> dict:
        # Repair the handoff: drop torn/unstable versions and any "future" beyond the resumed step,
        # then (re)publish the current version so rollout ranks can start.
        if self.lead:
            self.handoff.clean(keep_upto=self.step)
        self._publish()
        if self.comm is not None:
            self.comm.bcast(self.step, root=0)
        if self.peer is not None:
            return self._run_peer()
        if self.control is None:
            return self._train_and_finish()
        # a multi-rank run: the rollout ranks wait for this rank's last word (stages/rlcore/preempt.py)
        try:
            metrics = self._train_and_finish()
        except self.ctx.Preempted:
            self.control.preempted(self.step)  # saved: rollout ranks leave after this rank exits
            raise
        except BaseException:
            self.control.failed()
            raise
        self.control.finished()
        return metrics

    def _run_peer(self) -> dict:
        """Trainer ranks 1..T-1: train, then leave only on rank 0's last word (in a Slurm step the
        first rank to exit non-zero gets the others killed, rank 0 in its checkpoint included)."""
        try:
            self.train()
        except self.ctx.Preempted:
            word = self.peer.wait_for_trainer()
            step = word.step if word is not None else self.step
            log(self.ctx.rank, "trainer", f"preemption: leaving after trainer rank 0's checkpoint of step {step}")
            raise
        self.checkpoints.finish(meta={})  # rank 0 writes final/: every rank takes part in the gathers
        word = self.peer.wait_for_trainer()
        if word is not None and word.word == FAILED:
            raise RuntimeError(f"rl trainer rank {self.ctx.rank}: trainer rank 0 failed; see its traceback")
        return {"role": "trainer", "updates": self.step, "train_seconds": round(self.train_seconds, 2)}

    def _train_and_finish(self) -> dict:
        self.train()
        self.checkpoints.finish(meta={"stage": self.ctx.name, "seed": self.ctx.seed})
        history = self.log.records
        metrics = {
            "updates": self.step,
            "train_seconds": round(self.train_seconds, 2),
            "wait_seconds": round(self.wait_seconds, 2),
            "sampled_tokens_per_s": round(self.sampled_tokens / max(self.train_seconds, 1e-9), 1),
            "best_step": self.checkpoints.retention.best(),
            **self.eval_cache,
            **{f"initial_{k}": v for k, v in (history[0] if history else {}).items() if k.startswith(f"{self.split}/")},
            "final_reward_mean": history[-1].get("reward/mean") if history else None,
            "mismatch_kl_alarm_updates": int(sum(r.get("alarm/mismatch_kl", 0.0) for r in history)),
            # roles: a trainer rank of its own never imports the rollout engine (world size 1 plays both)
            "trainer_imported_vllm": "vllm" in sys.modules,
            "precision": self.backend.precision.record(),
            "weights_unchanged": unchanged_fraction(self.init_path, self.out / "checkpoints" / "final", self.model.config),
        }
        atomic_write_json(self.out / "metrics.json", metrics)
        return metrics
