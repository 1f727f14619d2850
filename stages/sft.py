"""SFT stage: tokenizer, model initialisation, supervised fine-tuning on task demonstrations.

Inputs: the tasks stage (train split = demonstrations; val split = a quick greedy check).
Outputs in ctx.out_dir:
    checkpoints/initial/        the initializer, before any update (model dir)
    checkpoints/step_NNNNNN/    resumable (model dir + trainer_state/), every `save_every` steps
    checkpoints/final/          the trained model (model dir); checkpoints/best -> "final"
    metrics_history.jsonl       one line per step (`snowcat plot` draws it: plots/loss.png); metrics.json (headline)
    teacher_demos.json          the scripted expert's repository-task episodes (made once, by rank 0)

Demonstrations are chat conversations (user: task prompt, assistant: reference answer), loss on
assistant tokens only, packed into fixed-length rows (attention never crosses examples). A
`relay_fraction` of them are Relay-style (see docs/training.md): a student starts, the teacher takes
over; the student's tokens are context (masked), the teacher's are trained. Repository tasks
(verifier `repo`) are demonstrated by the scripted expert in RepoEnv instead — real tool calls in
sandboxes, every observation as the environment returns it (`stages.agent.teacher_messages`) — and
take no Relay variant.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, build_manifest
from snowcat.pipeline.offline import load_index, staged_revision
from snowcat.pipeline.retention import RetentionPolicy
from snowcat.pipeline.schema import HF_PREFIX, hub_id
from snowcat.stages.agent import teacher_messages
from snowcat.stages.agent.demos import read_demos
from snowcat.stages.agent.repo_env import picked
from snowcat.stages.agent.traces import TraceError, import_traces
from snowcat.stages.config import TEACHER_PREFIX
from snowcat.stages.config import SftConfig as Config
from snowcat.stages.model import PRESETS, MoEForCausalLM, count_params, hf, load_model_dir, open_model_dir, save_model_dir
from snowcat.stages.model.io import copy_model_dir
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.scoring import pass_rates, sample_attempts
from snowcat.stages.taskgen import demonstration, load_tasks, verify
from snowcat.stages.tokenizer import message_text, train_tokenizer
from snowcat.stages.train import Example, OptimConfig, PackedLoader, StepStats, latest_checkpoint, load_for_training, make_backend
from snowcat.stages.train.backend import distributed, local_device
from snowcat.stages.train.loop import Checkpoints, MetricsLog, TrainLoop
from snowcat.stages.train.loss import sft_loss
from snowcat.stages.train.precision import resolve, stored_dtype, unchanged_fraction

RETRY_PROMPT = "That is not right. Try again."


# ---------------------------------------------------------------- data construction


def _corrupt(answer: str, alphabet: str, rng) -> str:
    """A plausible wrong answer: one character replaced, dropped or doubled."""
    for _ in range(20):
        i = int(rng.integers(len(answer)))
        op = int(rng.integers(3))
        if op == 0:
            wrong = answer[:i] + alphabet[int(rng.integers(len(alphabet)))] + answer[i + 1 :]
        elif op == 1 and len(answer) > 1:
            wrong = answer[:i] + answer[i + 1 :]
        else:
            wrong = answer[: i + 1] + answer[i:]
        if wrong != answer and wrong.strip():
            return wrong
    return answer + answer[-1]


def teacher_demos(
    tasks, sandbox: dict | None = None, progress=None, detours: float = 0.0, explores: float = 0.0
) -> dict[str, list[dict]]:
    """task id -> the scripted expert's RepoEnv episode, for the repository tasks among `tasks`
    (tool calls in sandboxes: run side by side, bounded by the cores); a `detours` share of them
    open a wrong file first. An `explores` share of the tasks is demonstrated a second time, under
    task id + `EXPLORING`, the expert reading the test module too (`stages.agent.repo_env.teacher_episode`):
    both ways for one task, so that the habit is a coin the student tosses, not a property of the task
    it could learn by heart."""
    repo_tasks = [t for t in tasks if t.verifier == "repo"]
    out: dict[str, list[dict]] = {}

    def demonstrate(t) -> dict[str, list[dict]]:
        options = {"detour": picked(t, detours, "detour"), **(sandbox or {})}
        demos = {t.task_id: teacher_messages(t, "repo", **options)}
        if picked(t, explores, "explore"):
            demos[t.task_id + EXPLORING] = teacher_messages(t, "repo", explore=True, **options)
        return demos

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        for i, demos in enumerate(pool.map(demonstrate, repo_tasks)):
            out.update(demos)
            if progress is not None and ((i + 1) % 50 == 0 or i + 1 == len(repo_tasks)):
                progress(i + 1, len(repo_tasks))
    if repo_tasks:  # said once per run of the expert: a multi-rank stage must say it once
        print(f"[snowcat] scripted expert: {len(out)} repository-task episodes run in sandboxes", flush=True)
    return out


DEMOS_FILE = "teacher_demos.json"
EXPLORING = "#explore"  # the key suffix of a task's exploring demonstration (explore_fraction)


def shared_teacher_demos(
    path: Path, tasks, sandbox: dict, rank: int, progress=None, detours: float = 0.0, explores: float = 0.0
) -> dict[str, list[dict]]:
    """`teacher_demos` made once for every rank: rank 0 runs the expert (unless an earlier attempt
    of this stage left them for the same tasks and sandbox) and writes `path` atomically; every rank,
    rank 0 too, reads them back from it, so all train on the same bytes and a resumed stage on those
    of the first attempt. The others poll for the file (no collective: the expert may take longer
    than a process group's time-out); a rank 0 that dies takes the job step with it (mpirun, srun
    --kill-on-bad-exit). No repository task: no file."""
    repo_tasks = [t for t in tasks if t.verifier == "repo"]
    if not repo_tasks:
        return {}
    # (no detours or explores: the key of files written before there were any, which a resumed stage still finds)
    what = [sandbox, [[t.task_id, t.prompt, t.answer, t.meta] for t in repo_tasks]] + ([detours] if detours else [])
    what += [{"explore": explores}] if explores else []
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def read() -> dict | None:
        try:
            doc = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return doc["demos"] if doc.get("key") == key else None

    if rank == 0 and read() is None:
        # key order kept (no sort_keys): templates render tool schemas and arguments in the order given
        atomic_write_text(
            path, json.dumps({"key": key, "demos": teacher_demos(repo_tasks, sandbox, progress, detours, explores)})
        )
    while (demos := read()) is None:
        time.sleep(1.0)
    return demos


def build_conversations(tasks, relay_fraction: float, seed: int, demos: dict | None = None) -> list[tuple[list[dict], str]]:
    """(messages, domain) per demonstration: every task once plainly, plus Relay variants of a
    `relay_fraction` sample of tasks, alternating the two take-over points:
      handoff: the student wrote the first part of the answer; the teacher continues the same turn.
      fix:     the student answered wrongly; after the verifier's "try again" the teacher answers.
    The student here is synthetic (a prefix or a one-character corruption of the reference); with
    a real policy its sampled turns are used instead, unchanged (token-in, token-out)."""

    rng = np.random.default_rng([seed, 1])
    demos = demos or {}
    convs = [(demos[t.task_id] if t.task_id in demos else t.messages(), t.domain) for t in tasks]
    convs += [(demos[t.task_id + EXPLORING], t.domain) for t in tasks if t.task_id + EXPLORING in demos]
    tasks = [t for t in tasks if t.task_id not in demos]  # Relay: single-answer tasks only
    alphabets: dict[str, str] = {}
    for t in tasks:
        alphabets[t.domain] = "".join(sorted(set(alphabets.get(t.domain, "")) | set(t.answer)))
    n_relay = int(round(relay_fraction * len(tasks)))
    for j, i in enumerate(rng.permutation(len(tasks))[:n_relay]):
        t = tasks[int(i)]
        user = {"role": "user", "content": t.prompt}
        teacher = demonstration(t)
        if j % 2 == 0 and len(teacher) > 1:
            k = int(rng.integers(1, len(teacher)))
            convs.append(([user, {"role": "assistant", "student_prefix": teacher[:k], "content": teacher[k:]}], t.domain))
        else:
            wrong = _corrupt(t.answer, alphabets[t.domain], rng)
            convs.append(
                (
                    [
                        user,
                        {"role": "assistant", "content": wrong, "train": False},
                        {"role": "user", "content": RETRY_PROMPT},
                        {"role": "assistant", "content": teacher},
                    ],
                    t.domain,
                )
            )
    return convs


def tokenizer_corpus(tasks, demos: dict | None = None) -> list[str]:
    demos = demos or {}
    texts = [message_text(m) for msgs in demos.values() for m in msgs]
    return [t.prompt for t in tasks] + [demonstration(t) for t in tasks if t.task_id not in demos] + texts + [RETRY_PROMPT]


def weighted(conversations: list, weight: float, seed: int, source: str) -> list:
    """A source's conversations `weight` times per epoch: each floor(weight) times, and a seeded share
    frac(weight) of them once more (drawn by source name and seed; weight 1: each once, no draw)."""
    whole, frac = int(weight), weight - int(weight)
    out = [c for c in conversations for _ in range(whole)]
    if frac > 0:
        rng = np.random.default_rng([seed, 3, zlib.crc32(source.encode())])
        n = int(round(frac * len(conversations)))
        out += [conversations[int(i)] for i in sorted(rng.permutation(len(conversations))[:n])]
    return out


def teacher_conversations(ctx, cfg: Config, mix: dict) -> list[tuple[list[dict], str]]:
    """(messages, "teacher:<stage>") of every `teacher:<stage>` source of `mix` with a weight > 0: the
    stage's verified successes as text, rendered later through this model's chat template."""
    out = []
    for source, w in sorted(mix.items()):
        kind, _, stage = source.partition(":")
        if kind != TEACHER_PREFIX or w <= 0:
            continue
        if stage not in ctx.inputs:
            raise UserError(f"stages.{ctx.name}.mix.{source}: stage {stage!r} is not in needs")
        try:
            out += [(d["messages"], source) for d in read_demos(ctx.inputs[stage])]
        except FileNotFoundError as e:
            raise UserError(f"stages.{ctx.name}.mix.{source}: {e}") from None
    return out


# ---------------------------------------------------------------- helpers


def _tasks_dir(ctx, cfg: Config) -> Path:
    if cfg.tasks_input in ctx.inputs:
        return Path(ctx.inputs[cfg.tasks_input])
    raise UserError(f"sft: needs the tasks stage {cfg.tasks_input!r} (sft.tasks_input); inputs are {sorted(ctx.inputs)}")


def greedy_pass_rate(model, tok, tasks, max_new_tokens: int) -> dict:
    """Greedy pass@1 per domain on `tasks` (verifier failures counted apart, never as fails)."""
    params = SamplingParams(0.0, 0, 1.0, max_new_tokens, (tok.end_of_turn_id,))
    scored = sample_attempts(TorchEngine(model), tok, tasks, params, attempts=1, seed=0, verifier=verify)
    res = {f"val_greedy_pass@1/{d}": v for d, v in pass_rates(scored).items() if d != "all"}
    res["val_greedy_infra_errors"] = sum(not r.scored for r in scored)
    return res


def open_pretrained(ctx, cfg: Config, rank: int, world_size: int):
    """(path, model config, tokenizer) of the `hf:` checkpoint named by `model`; its size is printed
    before loading."""
    path = ctx.checkpoint(cfg.model, "model")
    mcfg, tok = open_model_dir(path)
    if rank == 0:
        print(
            f"[snowcat] {cfg.model}: " + hf.describe(mcfg, backend=cfg.backend, zero_stage=cfg.zero_stage, world_size=world_size),
            flush=True,
        )
    if tok is None:
        raise UserError(
            f"stages.{ctx.name}.model: {cfg.model!r} ({path}) has no tokenizer (tokenizer.json + tokenizer_config.json)"
        )
    return path, mcfg, tok


def lineage(ctx, cfg: Config) -> dict:
    """Where the pretrained initializer came from, for the card: hub id, revision, license, the
    sha256 of each of its files (and of the staged copy as prestage recorded it)."""
    path = ctx.checkpoint(cfg.model, "model")
    repo = hub_id(cfg.model)
    entry: dict = {}
    if repo is not None and ctx.run_config is not None:
        for stage in ctx.run_config.stages.values():
            if stage.kind == "prestage":
                entry = load_index(stage.staging_dir).get(repo, entry)
    parents, relation = hf.checkpoint_parents(path)
    return {
        "source": cfg.model,
        "hub_id": repo,
        "revision": staged_revision(entry) or hf.snapshot_revision(path),
        "requested_revision": (entry.get("hub") or {}).get("requested_revision"),
        "staged_sha256": entry.get("sha256"),
        "license": hf.checkpoint_license(path),
        "parents": parents,
        "parents_relation": relation,
        "files": {name: e["sha256"] for name, e in build_manifest(path).items()},
    }


def _summed_over_ranks(parts: list[torch.Tensor], backend) -> list[torch.Tensor]:
    """Each tensor summed over the data-parallel ranks (one all-reduce; float64)."""
    flat = torch.cat([p.detach().double().reshape(-1).to(backend.device) for p in parts])
    if backend.data_ranks > 1:
        dist.all_reduce(flat, group=backend.data_group)
    return list(flat.cpu().split([p.numel() for p in parts]))


# ---------------------------------------------------------------- the stage


class SftLoop(TrainLoop):
    """Packed demonstration rows in, token-mean NLL (+ router losses) out; the loader's position is checkpointed."""

    def __init__(self, ctx, backend, checkpoints, log, cfg: Config, loader: PackedLoader, domains: list[str]):
        super().__init__(ctx, backend, checkpoints, log, steps=cfg.steps, save_every=cfg.save_every)
        self.loader, self.domains = loader, domains

    def next_batch(self, k: int) -> list[dict]:
        return self.loader.next()

    def loss_fn(self, model, batch, n_tokens, n_micro):
        return sft_loss(model, batch, n_tokens, n_micro, len(self.domains))

    def client_state(self) -> dict:
        return {"loader": self.loader.state_dict()}

    def record(self, stats: StepStats, batch: list[dict]) -> dict:
        # the step's loss over every rank's rows, not rank 0's share of them
        parts = [stats.sums["nll_sum"], torch.tensor(stats.tokens)]
        if "domain_nll" in stats.sums:
            parts += [stats.sums["domain_nll"], stats.sums["domain_tokens"]]
        nll, tokens, *domain = _summed_over_ranks(parts, self.backend)
        rec = {"loss": float(nll) / max(float(tokens), 1), **stats.record(), "epoch": self.loader.epoch}
        if domain:
            nll, tokens = domain
            rec.update({f"loss/{d}": float(nll[i]) / float(tokens[i]) for i, d in enumerate(self.domains) if float(tokens[i])})
        return rec

    def progress_numbers(self, rec: dict) -> dict:
        return {"loss": rec["loss"], "tok/s": rec["tokens_per_s"]}


def run(ctx) -> dict:
    cfg: Config = ctx.config
    torch.set_num_threads(cfg.threads or ctx.threads)
    suffix = getattr(getattr(ctx.run_config, "site", None), "master_addr_suffix", "") or ""
    with distributed(ctx.world_size, addr_suffix=suffix) as (rank, world_size):
        return _train(ctx, cfg, rank, world_size)


def _train(ctx, cfg: Config, rank: int, world_size: int) -> dict:
    out = Path(ctx.out_dir)
    ckpts = out / "checkpoints"
    tasks_dir = _tasks_dir(ctx, cfg)
    train_tasks = load_tasks(tasks_dir, "train")
    domains = sorted({t.domain for t in train_tasks})
    mix = dict(cfg.mix) or {"tasks": 1.0, "traces": 1.0}
    sampled = teacher_conversations(ctx, cfg, mix)  # teacher:<stage> sources: (messages, source) per demonstration
    demos = shared_teacher_demos(
        out / DEMOS_FILE,
        train_tasks,
        cfg.sandbox.options(),
        rank,
        functools.partial(ctx.progress, unit="demonstrations", phase="teacher"),
        cfg.detour_fraction,
        cfg.explore_fraction,
    )

    # Model + tokenizer: resume > init_from > fresh (seeded) init, which is saved as `initial` (a
    # pretrained checkpoint is copied there as it is). A model directory is read by the backend
    # (load_for_training: under fsdp each rank reads only its slices), a fresh init made here.
    resume = latest_checkpoint(ckpts)
    source = resume or (ctx.checkpoint(cfg.init_from, "init_from") if cfg.init_from else None)
    model = None
    if source is None and (ckpts / "initial").is_dir():
        source = ckpts / "initial"
    if source is not None:
        mcfg, tok = open_model_dir(source)
    elif cfg.model.startswith(HF_PREFIX):
        source, mcfg, tok = open_pretrained(ctx, cfg, rank, world_size)
        if rank == 0:
            meta = {"stage": ctx.name, "seed": ctx.seed, "step": 0, "lineage": lineage(ctx, cfg)}
            copy_model_dir(source, ckpts / "initial", tok, meta=meta)
    else:
        extra = [message_text(m) for msgs, _ in sampled for m in msgs if m.get("content")]
        tok = train_tokenizer(tokenizer_corpus(train_tasks, demos) + extra, cfg.tokenizer_vocab_size)
        mcfg = PRESETS[cfg.model]
        vocab = tok.vocab_size
        if cfg.backend == "megatron":  # rows split over TP ranks: padded as Megatron pads (unused ids, trained as any row)
            vocab = -(-vocab // 128) * 128
        mcfg = dataclasses.replace(mcfg, vocab_size=vocab)
        torch.manual_seed(ctx.seed)
        model = MoEForCausalLM(mcfg)
        if rank == 0:
            save_model_dir(ckpts / "initial", model, tok, meta={"stage": ctx.name, "seed": ctx.seed, "step": 0})
    if tok is None:
        raise UserError(f"stages.{ctx.name}: {source} has no tokenizer (tokenizer.json + tokenizer_config.json)")
    if tok.vocab_size > mcfg.vocab_size:
        raise UserError(f"sft: tokenizer has {tok.vocab_size} ids but the model only {mcfg.vocab_size}")
    device = local_device(ctx.local_rank)
    # the starting checkpoint (init_from, or `initial`: a fresh init or the hub's files as they are)
    # decides what `storage_dtype: auto` stores, resumed or not
    origin = ctx.checkpoint(cfg.init_from, "init_from") if cfg.init_from else ckpts / "initial"
    origin = origin if origin.is_dir() else source
    precision = resolve(cfg, device, stored_dtype(origin) if origin is not None else torch.float32, f"stages.{ctx.name}")
    if model is not None:
        model.to(precision.master)

    # Data: deterministic from (tasks, tokenizer, seed); the loader's position is checkpointed.
    examples = []
    conversations = []
    if mix.get("tasks", 0) > 0:
        own = build_conversations(train_tasks, cfg.relay_fraction, ctx.seed, demos)
        conversations += weighted(own, mix["tasks"], ctx.seed, "tasks")
    traces = []
    for i, path in enumerate(cfg.traces if mix.get("traces", 0) > 0 else []):
        try:
            traces += [(msgs, "traces") for msgs in import_traces(path)]
        except (OSError, TraceError) as e:
            raise UserError(f"stages.{ctx.name}.traces[{i}]: {e}") from None
    if traces:
        conversations += weighted(traces, mix["traces"], ctx.seed, "traces")
        domains.append("traces")
    for name in sorted({src for _, src in sampled}):  # not `source`: that is the model directory loaded below
        conversations += weighted([c for c in sampled if c[1] == name], mix[name], ctx.seed, name)
        domains.append(name)
    dom_index = {d: i for i, d in enumerate(domains)}
    for msgs, dom in conversations:
        ids, mask = tok.encode_chat(msgs)
        examples += [Example(ids, mask, dom_index[dom])] * int(cfg.domain_repeats.get(dom, 1))
    optim = OptimConfig(
        lr=cfg.lr,
        min_lr_ratio=cfg.min_lr_ratio,
        warmup_steps=cfg.warmup_steps,
        total_steps=cfg.steps,
        schedule=cfg.schedule,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
    )
    layout = {"zero_stage": cfg.zero_stage, "expert_parallel": cfg.expert_parallel}
    if cfg.backend == "megatron":
        layout |= {"tensor_parallel": cfg.tensor_parallel, "pipeline_parallel": cfg.pipeline_parallel}
    if model is None:  # verified above
        backend, _ = load_for_training(
            source,
            cfg.backend,
            optim,
            device=device,
            precision=precision,
            activation_checkpointing=cfg.activation_checkpointing,
            verify=False,
            **layout,
        )
    else:
        model.to(device).set_activation_checkpointing(cfg.activation_checkpointing)
        backend = make_backend(cfg.backend, model, optim, precision=precision, **layout)
    # each data-parallel rank its rows (tensor- and pipeline-parallel ranks share a replica's)
    loader = PackedLoader(
        examples, cfg.seq_len, tok.pad_id, cfg.batch_rows, ctx.seed, cfg.micro_batches, backend.data_rank, backend.data_ranks
    )
    # no metric during SFT: retention keeps the last `keep_last` (and records what it deletes)
    policy = RetentionPolicy(metric="val/pass@1", keep_best=1, keep_last=cfg.keep_last)
    checkpoints = Checkpoints(
        ckpts, backend, tok, policy, meta={"stage": ctx.name, "seed": ctx.seed, "tokenizer": tok.fingerprint()}, seed=ctx.seed
    )
    client = checkpoints.restore()
    if client is not None:
        loader.load_state_dict(client["loader"])
    log = MetricsLog(
        out / "metrics_history.jsonl",
        restored_step=backend.step if client else None,
        stage=ctx.name,
        run_dir=ctx.run_dir,
        writer=rank == 0,
    )
    loop = SftLoop(ctx, backend, checkpoints, log, cfg, loader, domains)
    loop.train()

    history = log.records
    metrics: dict = {
        "steps": backend.step,
        "train_seconds": round(loop.train_seconds, 2),
        "tokens_per_s": round(loop.tokens_processed / max(loop.train_seconds, 1e-9), 1),
        "final_loss": history[-1]["loss"] if history else None,
        "num_examples": len(examples),
        "num_params": count_params(mcfg)[0],
        "precision": precision.record(),
    }
    checkpoints.finish(meta={"stage": ctx.name, "seed": ctx.seed})  # final/: whole weights (every rank gathers)
    if rank == 0:
        metrics["weights_unchanged"] = unchanged_fraction(origin, ckpts / "final", mcfg)
        if cfg.eval_tasks:
            val = [t for d in domains for t in [v for v in load_tasks(tasks_dir, "val") if v.domain == d][: cfg.eval_tasks]]
            # the model final/ holds (under ZeRO-3 this rank's own copy has a slice of each weight)
            final, _, _ = load_model_dir(ckpts / "final", dtype=precision.master)
            metrics.update(greedy_pass_rate(final.to(device), tok, val, cfg.eval_max_new_tokens))
        atomic_write_json(out / "metrics.json", metrics)
    return metrics
