"""RL stage: asynchronous trainer + rollout ranks, GRPO/RLOO-N with truncated importance sampling.

Roles (one MPI world; hetjob components `trainer` then `rollout`, or ranks under `mpirun`):
    ranks 0..T-1 (trainer)  data parallel in their own torch process group: rank 0 receives batch k
                            and broadcasts it to the others, each trains on its slice of the rows,
                            rank 0 publishes weights step k+1 (and logs, evaluates, keeps the ledger)
    ranks T.. (rollout)     produce batch k with the weights of step max(0, k - lag), exactly
With world size 1 one process alternates both roles through the same interfaces (file queue).
Trajectories move through `stages.rlcore.transport`, weights through `stages.rlcore.handoff`.

Outputs in ctx.out_dir:
    checkpoints/initial/  step_NNNNNN/ (model dir + trainer_state, retention: best + last K)
    checkpoints/final/    checkpoints/best (file naming the best step dir)   -> `rl:best`, `rl:final`
    weights/step_N/       the handoff versions still needed;  queue/  pending batches (file transport)
    metrics_history.jsonl, metrics.json; rows in the run's history.h5
    trajectories/         each batch trained on, step_<k>.parquet (rank 0; stages/agent/dataset.py)
    engine_rank<r>.json   a vLLM rollout rank's reload/check/rebuild counters (engine/* in the history)
    teacher.json          with teacher rollouts: the teacher served (reference, digest of its files'
                          manifest, tokenizer fingerprint, episodes per task), for the card
Resume: the newest verified checkpoint holds policy, optimizer, RNG and the policy version; data
order and sampling seeds are functions of (seed, batch index), so pending batches are simply
regenerated, bit-identically (docs/rl.md).
Preemption (SIGUSR2/SIGTERM reaching any subset of the ranks): the trainer finishes its step and
its checkpoint while rollout ranks wait; they leave after it (`stages.rlcore.preempt`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, build_manifest, read_json
from snowcat.stages.agent import BatchBuffers
from snowcat.stages.agent.prompting import resolve_rollout_prompt
from snowcat.stages.agent.summariser import context_policy
from snowcat.stages.config import RlConfig as Config
from snowcat.stages.config import other_tokenizer, rl_role, rl_roles_ok
from snowcat.stages.model import open_model_dir
from snowcat.stages.model.layout import Layout as MegatronLayout
from snowcat.stages.rlcore.episodes import generate_batch
from snowcat.stages.rlcore.handoff import HandoffError, WeightHandoff, version_for_batch
from snowcat.stages.rlcore.preempt import BYE, FAILED, RolloutControl, TrainerControl, TrainerSignal, log
from snowcat.stages.rlcore.trainer import Trainer
from snowcat.stages.rlcore.transport import FileQueueTransport, MPITransport, TransportError, rollout_owner
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.scoring import serve_checkpoint
from snowcat.stages.taskgen import load_tasks, selection_split
from snowcat.stages.tokenizer import load_tokenizer
from snowcat.stages.train.backend import leave_distributed
from snowcat.stages.train.rendezvous import init_process_group, rendezvous

# ---------------------------------------------------------------- data


def load_pool(ctx, cfg: Config):
    """Training tasks (the select stage's band when available, else the tasks stage's train split) and the
    held-out tasks checkpoints are selected on (the dev split when there is one, else val)."""

    if cfg.tasks_input not in ctx.inputs:
        raise UserError(f"rl: needs the tasks stage {cfg.tasks_input!r} (rl.tasks_input); inputs are {sorted(ctx.inputs)}")
    tasks_dir = Path(ctx.inputs[cfg.tasks_input])
    train = load_tasks(tasks_dir, "train")
    pool = train
    band = Path(ctx.inputs[cfg.band_input]) / "band.parquet" if cfg.band_input in ctx.inputs else None
    if band is not None and band.is_file():
        wanted = set(pq.read_table(band, columns=["task_id"]).column("task_id").to_pylist())
        if not wanted:
            raise UserError(f"{band}: the band is empty ({_band_said(band.parent)}): RL has no task to learn from")
        pool = [t for t in train if t.task_id in wanted]
        if not pool:
            raise UserError(f"{band}: none of its task_ids is in {tasks_dir}/train.parquet")
    if cfg.domains:
        pool = [t for t in pool if t.domain in set(cfg.domains)]
        if not pool:
            raise UserError(f"rl.domains={list(cfg.domains)}: no training task in these domains")
    domains = sorted({t.domain for t in pool})
    if cfg.domain_weights:  # rehearsal: the weighted domains are trained, every named one is held out
        for d, w in sorted(cfg.domain_weights.items()):
            if w > 0 and not any(t.domain == d for t in pool):
                raise UserError(
                    f"stages.{ctx.name}.domain_weights.{d}: no training task of domain {d!r} (domains: {', '.join(domains)})"
                )
        pool = [t for t in pool if cfg.domain_weights.get(t.domain, 0) > 0]
        domains = sorted(cfg.domain_weights)
    if len(pool) < cfg.tasks_per_update:
        raise UserError(f"rl.tasks_per_update={cfg.tasks_per_update} exceeds the {len(pool)} training tasks")
    val = load_tasks(tasks_dir, selection_split(tasks_dir))
    per = max(1, cfg.eval_tasks // max(1, len(domains)))
    held_out = [t for d in domains for t in [v for v in val if v.domain == d][:per]]
    return pool, held_out


def _band_said(select_dir: Path) -> str:
    """What the select stage says of its band, for an error: the bounds, attempts and tasks probed."""
    try:
        said = json.loads((select_dir / "select.json").read_text())
        low, high = said["band"]
        return f"no task of the {said['probed']} probed passed {low} to {high} of {said['attempts']} attempts; widen select's min_pass/max_pass or probe more tasks"
    except (OSError, ValueError, KeyError, TypeError):
        return "select.json unreadable"


def batch_tasks(pool: list, tasks_per_update: int, seed: int, batch_index: int) -> list:
    """Tasks of batch k: slice k of an endless sequence of seeded per-epoch permutations, so the
    data order is a pure function of (seed, k) and needs no state to resume."""

    n = len(pool)
    out = []
    for pos in range(batch_index * tasks_per_update, (batch_index + 1) * tasks_per_update):
        epoch, i = divmod(pos, n)
        out.append(pool[int(np.random.default_rng([seed, 7, epoch]).permutation(n)[i])])
    return out


def _mix(weights: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """The trained domains (weight > 0) and their weights, in name order: the key of the memo below."""
    return tuple(sorted((d, float(w)) for d, w in weights.items() if w > 0))


def _shares(mix: tuple, per_batch: int) -> tuple[dict[str, int], dict[str, Fraction]]:
    """floor(p·B) per domain and the fraction left over (exact: Fractions of the weights as given)."""
    total = sum(Fraction(w) for _, w in mix)
    exact = {d: Fraction(w) / total * per_batch for d, w in mix}
    base = {d: math.floor(x) for d, x in exact.items()}
    return base, {d: exact[d] - base[d] for d in exact}


@functools.lru_cache(maxsize=8)
def _ceilings(mix: tuple, per_batch: int) -> list[dict[str, int]]:
    """Row k: how many of batches 0..k-1 gave each domain its ceiling (grown on demand by `_given`)."""
    return [dict.fromkeys((d for d, _ in mix), 0)]


def _given(mix: tuple, per_batch: int, batches: int) -> dict[str, int]:
    table = _ceilings(mix, per_batch)
    _, frac = _shares(mix, per_batch)
    extra = int(sum(frac.values()))  # ceilings handed out per batch: B - sum of the floors
    order = [d for d, _ in mix]
    while len(table) <= batches:
        k, given = len(table) - 1, dict(table[-1])
        owed = {d: frac[d] * (k + 1) - given[d] for d in order}
        for d in sorted(order, key=lambda d: (-owed[d], order.index(d)))[:extra]:
            given[d] += 1
        table.append(given)
    return table[batches]


def domain_quotas(weights: dict[str, float], per_batch: int, batch_index: int) -> dict[str, int]:
    """Tasks of each trained domain (weight > 0, name order) in batch k. A domain of share
    p = w / sum(w) gets floor(p·B) or ceil(p·B) tasks in every batch; the B - sum(floors) ceilings of
    a batch go to the domains owed most (owed = frac(p·B)·(k+1) - ceilings so far; ties by name),
    so over the first K batches a domain's total stays within one task of p·B·K. Exact (fractions),
    a pure function of (weights, B, k)."""
    mix = _mix(weights)
    base, _ = _shares(mix, per_batch)
    after, before = _given(mix, per_batch, batch_index + 1), _given(mix, per_batch, batch_index)
    return {d: base[d] + after[d] - before[d] for d in base}


def weighted_batch_tasks(pool: list, weights: dict[str, float], tasks_per_update: int, seed: int, batch_index: int) -> list:
    """Batch k under `rl.domain_weights`: `domain_quotas` tasks of each domain, in name order, each
    domain's tasks read on from its own endless sequence of seeded per-epoch permutations from where
    its earlier batches stopped, so the order is a pure function of (seed, k)."""
    mix = _mix(weights)
    base, _ = _shares(mix, tasks_per_update)
    before = _given(mix, tasks_per_update, batch_index)
    out = []
    for d, quota in domain_quotas(weights, tasks_per_update, batch_index).items():
        tasks = [t for t in pool if t.domain == d]
        n, tag = len(tasks), zlib.crc32(d.encode())
        first = base[d] * batch_index + before[d]  # the domain's tasks drawn by the earlier batches
        for pos in range(first, first + quota):
            epoch, i = divmod(pos, n)
            out.append(tasks[int(np.random.default_rng([seed, 7, tag, epoch]).permutation(n)[i])])
    return out


def tasks_of_batch(cfg: Config, pool: list, seed: int, batch_index: int) -> list:
    """The tasks of batch k: mixed by `domain_weights` when given, else `batch_tasks`."""
    if cfg.domain_weights:
        return weighted_batch_tasks(pool, cfg.domain_weights, cfg.tasks_per_update, seed, batch_index)
    return batch_tasks(pool, cfg.tasks_per_update, seed, batch_index)


def check_teacher_tokenizer(ctx, cfg: Config) -> None:
    """UserError naming `stages.<rl>.teacher` unless the teacher's tokenizer is the policy's: the same
    fingerprint (vocabulary, merges, special tokens, chat template), as the teacher stage decides
    whether a teacher reads the student's ids. What the config could not tell at load (run
    checkpoints, staged hub models); every rank, before any rollout."""
    toks = [load_tokenizer(ctx.checkpoint(ref, key)) for ref, key in ((cfg.init_from, "init_from"), (cfg.teacher, "teacher"))]
    if toks[1] is None:
        raise UserError(f"stages.{ctx.name}.teacher: {cfg.teacher!r} has no tokenizer")
    if toks[0] is None or type(toks[0]) is not type(toks[1]) or toks[0].fingerprint() != toks[1].fingerprint():
        raise UserError(f"stages.{ctx.name}.teacher: {other_tokenizer(cfg.init_from, cfg.teacher)}")


TEACHER_FILE = "teacher.json"


def record_teacher(ctx, cfg: Config) -> None:
    """`teacher.json`: which teacher played the teacher rollouts, as the teacher stage records its
    teacher (the sha256 of its files' manifest, its tokenizer's fingerprint); the card names it."""
    path = ctx.checkpoint(cfg.teacher, "teacher")
    record = {
        "teacher": cfg.teacher,
        "teacher_sha256": hashlib.sha256(json.dumps(build_manifest(path), sort_keys=True).encode()).hexdigest(),
        "tokenizer": load_tokenizer(path).fingerprint(),  # check_teacher_tokenizer: there is one
        "teacher_rollouts": cfg.teacher_rollouts,
    }
    atomic_write_json(Path(ctx.out_dir) / TEACHER_FILE, record)


def batch_seed(seed: int, batch_index: int) -> int:
    return int(np.random.SeedSequence([seed, 11, batch_index]).generate_state(1)[0])


# ---------------------------------------------------------------- roles


class Rollout:
    """Produces batch k with weights of step max(0, k - lag) loaded through the handoff, on the
    engine `rl.engine` names."""

    def __init__(self, ctx, cfg: Config, pool, handoff, transport, should_stop=None):
        self.ctx, self.cfg, self.pool = ctx, cfg, pool
        self.should_stop = should_stop or ctx.checkpoint_due
        self.engine, self.tok, _ = serve_checkpoint(ctx, cfg.init_from, "init_from", cfg.rollout_batch)
        # the teacher: served once beside the policy, on the same engine kind, never reloaded (fixed weights)
        self.teacher = None
        if cfg.teacher_rollouts:
            self.teacher, _, _ = serve_checkpoint(ctx, cfg.teacher, "teacher", cfg.rollout_batch)
        # rl.context: summarise past a threshold; a helper model that writes the summaries is served once
        self.context = context_policy(ctx, cfg, f"stages.{ctx.name}.context")
        self.params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (self.tok.end_of_turn_id,))
        self.handoff, self.transport = handoff, transport
        self.version: int | None = None
        self.stats_path = Path(ctx.out_dir) / f"engine_rank{ctx.rank}.json"
        self.earlier = read_json(self.stats_path) or {}  # counters of this rank before a restart
        self.buffers = BatchBuffers()  # each batch is written into the memory of one already sent

    def load(self, v: int) -> None:
        wait = {"timeout_s": self.cfg.timeout_s, "should_stop": self.should_stop}
        self.version = None  # until the load returns: a refused version may have been half read into the model
        if isinstance(self.engine, TorchEngine):
            self.handoff.load_into(self.engine.model, v, **wait)  # hashes the very bytes it reads into the model
        else:
            self.handoff.wait_verified(v, **wait)
            self.engine.load_weights(self.handoff.path(v))  # a STABLE version is never rewritten
            # the trainer adds these to its history (engine/*): reloads, checks, rebuilds, seconds
            totals = {k: self.earlier.get(k, 0) + n for k, n in self.engine.stats.items()}
            atomic_write_json(self.stats_path, {"version": v, **totals})
        self.version = v

    def produce(self, k: int) -> None:
        v = version_for_batch(k, self.cfg.lag)
        if v != self.version:
            self.load(v)
        tasks = tasks_of_batch(self.cfg, self.pool, self.ctx.seed, k)
        seed = batch_seed(self.ctx.seed, k)
        batch = generate_batch(
            self.engine, self.tok, tasks, self.cfg, self.params, seed, v, k, self.buffers, self.teacher, self.context
        )
        self.transport.send_batch(k, batch)


def _role(ctx) -> str:
    if ctx.world_size == 1:
        return "both"
    return rl_role(ctx.role, ctx.rank)


@dataclass(frozen=True)
class Layout:
    """Trainer ranks 0..trainers-1, rollout ranks trainers..world-1 (hetjob component order)."""

    trainers: int
    world: int

    @property
    def rollouts(self) -> int:
        return self.world - self.trainers


def layout(comm, role: str) -> Layout:
    """Every rank's role, gathered (collective over the world): trainer ranks must come first."""
    roles = comm.allgather(role)
    if not rl_roles_ok(roles):  # refused at load where the components say so (stages/config.py)
        raise UserError(
            f"rl: ranks must be trainer ranks first, then at least one rollout rank (resources.components: "
            f"trainer, then rollout); got {roles}"
        )
    return Layout(roles.count("trainer"), len(roles))


def _trainer_group(ctx, cfg: Config, comm, lay: Layout):
    """The trainer ranks' MPI sub-communicator (None for one trainer rank) and, where a backend needs
    one, their torch process group (stages.train.rendezvous: Slurm's or mpirun's environment)."""
    group = comm.Split(0 if ctx.rank < lay.trainers else 1, ctx.rank) if comm is not None else None
    if ctx.rank >= lay.trainers:
        return None, ctx
    if lay.trainers > 1 or cfg.backend != "torch":
        suffix = getattr(getattr(ctx.run_config, "site", None), "master_addr_suffix", "") or ""
        # one process alone (world size 1) forms a group of itself
        where = rendezvous(group, addr_suffix=suffix) if group is not None else rendezvous(env={})
        init_process_group(where)
        ctx = dataclasses.replace(ctx, local_rank=where.local_rank)
    return (group if lay.trainers > 1 else None), ctx


def run(ctx) -> dict:
    cfg: Config = ctx.config
    # `prompts:<stage>`: the prompt a prompt-selection stage chose (stages/prompts.py)
    cfg.rollout_prompt = resolve_rollout_prompt(cfg.rollout_prompt, ctx.inputs, f"stages.{ctx.name}.rollout_prompt")
    torch.set_num_threads(cfg.threads or ctx.threads)
    out = Path(ctx.out_dir)
    role = _role(ctx)
    pool, held_out = load_pool(ctx, cfg)
    if cfg.teacher_rollouts:  # every rank, before any rollout: the run checkpoints exist by now
        check_teacher_tokenizer(ctx, cfg)
        if ctx.rank == 0:
            record_teacher(ctx, cfg)
    handoff = WeightHandoff(out / "weights")

    comm = None
    mode = cfg.transport if cfg.transport != "auto" else ("mpi" if ctx.world_size > 1 else "file")
    if ctx.world_size > 1:
        from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

        comm = MPI.COMM_WORLD
        lay = layout(comm, role)
    else:
        lay = Layout(1, 1)
    if lay.trainers > cfg.tasks_per_update * cfg.attempts:
        raise UserError(
            f"rl.tasks_per_update: {cfg.tasks_per_update} tasks x {cfg.attempts} attempts is fewer trajectories "
            f"per batch than the {lay.trainers} trainer ranks"
        )
    if cfg.backend == "megatron":  # every rank refuses a layout that cannot hold the model, before any rank waits on another
        model_cfg, _ = open_model_dir(ctx.checkpoint(cfg.init_from, "init_from"), verify=False)
        for key, why in MegatronLayout.of(cfg).problems(model_cfg, lay.trainers):
            raise UserError(f"stages.{ctx.name}.{key}: {why}")
    group, ctx = _trainer_group(ctx, cfg, comm, lay)
    # Preemption in a multi-rank run (stages/rlcore/preempt.py): trainer rank 0's notice is its own
    # or another rank's; the other ranks stop when they see one or rank 0 says so; trainer ranks
    # agree on it at every step.
    control = peer = None
    if role == "trainer" and ctx.rank == 0:
        control = TrainerControl(comm, lay.trainers)
        own = ctx.signal
        local = lambda: control.due(own.is_set())  # noqa: E731 (rank 0's view, no collective)
        ctx = dataclasses.replace(
            ctx, signal=TrainerSignal(own, local, group, on_agreed=lambda: control.due(own.is_set(), agreed=True))
        )
        should_stop = local
    elif role == "trainer":
        peer = RolloutControl(comm, ctx, cfg.timeout_s, role="trainer")
        ctx = dataclasses.replace(ctx, signal=TrainerSignal(ctx.signal, peer.stop_requested, group))
        should_stop = peer.stop_requested
    elif role == "rollout":
        control = RolloutControl(comm, ctx, cfg.timeout_s)
        should_stop = control.stop_requested
    else:
        should_stop = ctx.checkpoint_due
    if mode == "mpi":
        if comm is None:
            raise UserError("rl.transport=mpi needs a world of at least 2 ranks (1 trainer + rollout ranks)")
        transport = MPITransport(
            comm, first_rollout=lay.trainers, n_rollout=lay.rollouts, timeout_s=cfg.timeout_s, should_stop=should_stop
        )
    else:
        transport = FileQueueTransport(out / "queue", timeout_s=cfg.timeout_s, should_stop=should_stop)

    if role == "rollout":
        return _run_rollout(ctx, cfg, comm, lay, control, pool, handoff, transport)

    trainer = Trainer(ctx, cfg, held_out, handoff, transport, comm, group=group)
    trainer.control, trainer.peer = control, peer
    trainer.tasks = {t.task_id: t for t in pool}
    if role == "both":
        trainer.local_rollout = Rollout(ctx, cfg, pool, handoff, transport)
    try:
        metrics = trainer.run()
    except BaseException:
        leave_distributed()
        raise
    leave_distributed(together=True)
    return metrics


def _run_rollout(ctx, cfg: Config, comm, lay: Layout, control: RolloutControl, pool, handoff, transport) -> dict:
    """Produce this rank's batches, then wait for the trainer's last word: END (done), BYE (the
    trainer's checkpoint is saved and it has left: leave too, Preempted) or FAILED."""
    start = comm.bcast(None, root=0)  # the trainer's resumed step: the first batch still needed
    worker = Rollout(ctx, cfg, pool, handoff, transport, should_stop=control.stop_requested)
    t0, made, stopped_at = time.perf_counter(), 0, None
    for k in range(start, cfg.updates):
        if rollout_owner(k, first_rollout=lay.trainers, n_rollout=lay.rollouts) != ctx.rank:  # the file transport has no owner()
            continue
        if control.stop_requested():
            stopped_at = k
            break
        try:
            worker.produce(k)
        except (HandoffError, TransportError):
            if not control.stop_requested():
                raise
            stopped_at = k  # nothing to save: the trainer's checkpoint regenerates this batch
            break
        made += 1
    if stopped_at is not None:
        log(ctx.rank, "rollout", f"stopped at batch {stopped_at}; waiting for the trainer's checkpoint")
    word = control.wait_for_trainer()
    if word is not None and word.word == FAILED:
        raise RuntimeError(f"rl rollout rank {ctx.rank}: the trainer (rank 0) failed; see its traceback")
    if word is not None and word.word == BYE:
        log(ctx.rank, "rollout", f"preemption: leaving after the trainer's checkpoint of step {word.step}")
        raise ctx.Preempted(f"rl rollout rank {ctx.rank}: the trainer checkpointed step {word.step}")
    if word is None and control.stop:
        log(ctx.rank, "rollout", f"preemption: no word from the trainer within {cfg.timeout_s:.0f}s (rl.timeout_s); leaving")
        raise ctx.Preempted(f"rl rollout rank {ctx.rank}: stopped at batch {stopped_at}")
    # END, or no word after the last batch: this rank is done (exit 0 never gets the trainer killed)
    engine = getattr(worker.engine, "stats", {})
    return {"role": "rollout", "engine": cfg.engine, "batches": made, "seconds": round(time.perf_counter() - t0, 2), **engine}
