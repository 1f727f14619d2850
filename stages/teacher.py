"""`teacher` stage: demonstrations by verified sampling (docs/recipes.md, "Teacher demonstrations").

A teacher model (`teacher`: a checkpoint of a needed stage, or a staged Hugging Face checkpoint) plays
the tasks stage's training tasks in the same agent loop, environment, tools and sandboxes as the
policy, on the engine the config names (torch or vLLM). Every episode is verified by the task's
verifier; a verified success (status ok, full credit) becomes an SFT demonstration, kept as chat
messages: the opening as the environment renders it, each assistant turn's text as the teacher
sampled it, each observation as the environment wrote it. The student's SFT renders them through its
own chat template (`sft.mix: {teacher:<stage>: w}`): nothing claims token identity across
tokenizers. An episode whose turn was cut by the turn budget (closed by the loop, not by the
teacher) is not a demonstration.

A job array: `fan_out: {shard: [0, ..., N-1]}`; element i plays the i-th of N contiguous blocks of
the (limited) train split. Episodes are seeded by (stage seed, task index in the whole split, attempt, turn), so
the union of the shards is what one unit would make, and a batch is the same whichever run makes it.
Resumable: each finished batch's demonstrations are kept in `partial/` and reused; a preempted
unit continues there, ending with the bytes of an uninterrupted one.

An OpenAI-compatible endpoint (`endpoint: {url, model, api_key_env, ...}`, docs/recipes.md) can be
the teacher instead: it plays the same loop turn by turn over HTTP (stages/rollout/endpoint.py),
its replies are text, rendered in and re-tokenised by the tokenizer of `tokenizer` (the student's);
the demonstrations' provenance says so (`tokens`), names the endpoint (URL, model, the identity it
returns, the models that answered each episode) and has no files' digest. An endpoint that cannot be
reached is refused before any episode; one that fails mid-stage makes its episodes infra failures.

Relay (`student: "<stage>:<checkpoint>"`, docs/recipes.md "Relay SFT with a real student"): the
student starts each episode and the teacher takes over at the first of the `takeover` points
(stages/agent/relay.py), in the same episode. The demonstration keeps the student's turns as context
(`train: False`: SFT masks them) and the teacher's as targets; only a verified episode the teacher
played in is kept. The episodes are the student's transcripts, in its tokenizer; a teacher with
another tokenizer reads them as text (`TextTeacher`).

Outputs per unit: `demos.jsonl` (one demonstration a line, with its provenance: the teacher's
reference and manifest digest, tokenizer fingerprint, sampling parameters, budget, environment,
seed, group and attempt, the verifier's verdict; with a student, its reference and digest, the
take-over points and where this episode's take-over happened), deduplicated by content;
`trajectories/` (every episode played, failures and infra failures too, as a dataset that `snowcat
traces` reads: why the teacher fails the tasks it fails; `keep_trajectories`); `teacher.json` (the
teacher's reference and digest; counts: episodes, verified successes, kept, duplicates, cut turns,
infra failures, per domain; with a student, its reference and digest and the take-overs per point).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from snowcat.pipeline.context import Preempted
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, build_manifest
from snowcat.stages.agent import Budget, EpisodeJob, make_env, run_episodes
from snowcat.stages.agent.dataset import DIRNAME, TrajectoryWriter, load_played, save_played
from snowcat.stages.agent.demos import DEMOS, ObservationLog, demo_id, demo_messages, domains_in_turn
from snowcat.stages.agent.relay import RelayEngine, TextTeacher, relay_messages
from snowcat.stages.config import TAKEOVER_POINTS, env_options, keep_trajectories
from snowcat.stages.config import TeacherConfig as Config
from snowcat.stages.model.io import load_model_config, open_model_dir
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.rollout.endpoint import ChatEndpoint, EndpointEngine
from snowcat.stages.scoring import serve_checkpoint
from snowcat.stages.taskgen import load_tasks
from snowcat.stages.verifiers import TimedVerifier, load_verifier


def _key(cfg: Config, seed: int, provenance: dict, task_ids: list[str]) -> str:
    """What a saved batch depends on: a batch saved under other settings is played again."""
    what = [seed, cfg.teacher, provenance["teacher_sha256"], cfg.env, cfg.require_tool, cfg.temperature, cfg.top_p, cfg.top_k]
    what += [cfg.max_context, cfg.max_turn_tokens, cfg.max_turns, cfg.attempts, cfg.infra_retries, cfg.verifier, task_ids]
    if "relay" in provenance:
        what.append(provenance["relay"])
    if "endpoint" in provenance:  # the model and what the endpoint says it is, not where it is (a requeued
        what.append({k: v for k, v in provenance["endpoint"].items() if k != "url"})  # job's server may move)
        what.append([provenance["tokenizer"], cfg.tokenizer, provenance["sampling"]["extra"]])
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()


def play_batch(engine, observations, batch, env, params, budget: Budget, seed: int, verifier, relay) -> tuple[list, list]:
    """(trajectories, per episode what its record adds) of a batch: played by the teacher alone (an
    endpoint: the models that answered), or with `relay` (the student engine, the teacher engine or
    TextTeacher, the take-over points and margin) by both (where the teacher took over)."""
    if isinstance(engine, ChatEndpoint):  # its turns re-tokenised by the loop's (the student's) tokenizer
        player = EndpointEngine(
            engine, student_tok=observations, observations=observations, env=env, jobs=batch, seed=seed, budget=budget
        )
        out = run_episodes(player, observations, batch, env, params, budget, seed, 0, verifier=verifier)
        return out, player.answered_by()
    if relay is None:
        out = run_episodes(engine, observations, batch, env, params, budget, seed, 0, verifier=verifier)
        return out, [None] * len(batch)
    student, teacher, points, margin = relay
    player = RelayEngine(student, teacher, env=env, jobs=batch, seed=seed, budget=budget, points=points, margin=margin)
    out = run_episodes(player, observations, batch, env, params, budget, seed, 0, verifier=verifier)
    return out, player.takeovers()


def play(
    engine,
    tok,
    tasks: list[tuple[int, object]],
    cfg: Config,
    seed: int,
    verifier,
    provenance: dict,
    partial: Path,
    stop,
    progress,
    make_relay=None,
):
    """(episode records, trajectories) of every (task index, task)'s `attempts` episodes, played in
    batches of `batch_size` episodes; per batch the records (verdict, and the messages of a verified
    success) and the trajectories saved in `partial/` and reused. With `make_relay` (`relay_player`),
    `tok` is the student's and the student starts each episode."""
    observations = ObservationLog(tok)
    env = make_env(cfg.env, observations, **env_options(cfg.env, cfg))
    relay = make_relay(observations, env) if make_relay is not None else None
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_turn_tokens, (tok.end_of_turn_id,))
    budget = Budget(cfg.max_context, cfg.max_turn_tokens, cfg.max_turns)
    # group id = the task's index in the whole split: a task's episodes do not depend on the sharding
    jobs = [EpisodeJob(task, group_id=i, attempt=a) for i, task in tasks for a in range(cfg.attempts)]
    key = _key(cfg, seed, provenance, [t.task_id for _, t in tasks])
    records: list[dict] = []
    trajs: list = []
    for b, start in enumerate(range(0, len(jobs), cfg.batch_size)):
        path = partial / f"batch_{b:06d}.json"
        saved = json.loads(path.read_text()) if path.is_file() else None
        played = load_played(path.with_suffix(".npz"), key) if saved is not None and saved.get("key") == key else None
        if played is not None:
            records += saved["episodes"]
            trajs += played
            continue
        batch = jobs[start : start + cfg.batch_size]
        out, handed = play_batch(engine, observations, batch, env, params, budget, seed, verifier, relay)
        for _ in range(cfg.infra_retries):  # the same seeds: a retry samples what the first try would have
            failed = [i for i, tr in enumerate(out) if tr.status == "infra_error"]
            if not failed:
                break
            again = play_batch(engine, observations, [batch[i] for i in failed], env, params, budget, seed, verifier, relay)
            for i, tr, h in zip(failed, *again):
                out[i], handed[i] = tr, h
        episodes = []
        for job, t, h in zip(batch, out, handed):
            rec = {
                "task_id": t.task_id,
                "domain": t.domain,
                "group_id": t.group_id,
                "attempt": t.attempt,
                "status": t.status,
                "reward": t.reward,
                "passed": bool(t.status == "ok" and t.passed),
                "detail": t.detail,
                "turns": len(t.turn_boundaries),
            }
            if relay is not None:
                rec["takeover"] = dataclasses.asdict(h) if h is not None else None
            elif isinstance(engine, ChatEndpoint):
                rec["answered_by"] = h
            if rec["passed"]:
                rec["messages"] = demo_messages(t, job.task, env, tok, observations)
                if relay is not None and h is not None and rec["messages"] is not None:
                    rec["messages"] = relay_messages(rec["messages"], h.turn)
            episodes.append(rec)
        save_played(path.with_suffix(".npz"), key, out)  # before the records: they mark the batch done
        atomic_write_text(path, json.dumps({"key": key, "episodes": episodes}, ensure_ascii=False))
        records += episodes
        trajs += out
        progress(len(records), len(jobs), unit="episodes", passed=sum(r["passed"] for r in records))
        if stop() and start + cfg.batch_size < len(jobs):
            raise Preempted(f"teacher: {b + 1} batches saved in {partial}")
    return records, trajs


def demonstrations(records: list[dict], keep: str, provenance: dict) -> tuple[list[dict], dict]:
    """The demonstrations of the verified successes (`keep`: all distinct ones, or the first per task),
    deduplicated by content, and the counts behind them."""
    counts = {"episodes": len(records), "verified": 0, "kept": 0, "duplicates": 0, "cut_turns": 0, "infra_failures": 0}
    relay = "relay" in provenance
    if relay:  # Relay: the take-overs per point, and the verified episodes the student played alone
        counts |= {"takeovers": dict.fromkeys(TAKEOVER_POINTS, 0), "student_alone": 0}
    seen: set[str] = set()
    taken: set[str] = set()
    demos = []
    for r in records:
        counts["infra_failures"] += r["status"] == "infra_error"
        if relay and r["takeover"] is not None:
            counts["takeovers"][r["takeover"]["point"]] += 1
        if not r["passed"]:
            continue
        counts["verified"] += 1
        if relay and r["takeover"] is None:  # no teacher turn: nothing to train on
            counts["student_alone"] += 1
            continue
        if r["messages"] is None:
            counts["cut_turns"] += 1
            continue
        if keep == "best" and r["task_id"] in taken:
            continue
        ident = demo_id(r["messages"])
        if ident in seen:
            counts["duplicates"] += 1
            continue
        seen.add(ident)
        taken.add(r["task_id"])
        verdict = {k: r[k] for k in ("status", "reward", "passed", "detail")}
        episode = {"group_id": r["group_id"], "attempt": r["attempt"], "verdict": verdict}
        if relay:
            episode["takeover"] = r["takeover"]
        if "answered_by" in r:
            episode["answered_by"] = r["answered_by"]
        demos.append(
            {
                "id": ident,
                "task_id": r["task_id"],
                "domain": r["domain"],
                "messages": r["messages"],
                "provenance": {**provenance, **episode},
            }
        )
    counts["kept"] = len(demos)
    return demos, counts


def _digest(path: Path) -> str:
    """The sha256 of a checkpoint's files' manifest."""
    return hashlib.sha256(json.dumps(build_manifest(path), sort_keys=True).encode()).hexdigest()


def teacher_provenance(ctx, cfg: Config, path: Path, tok) -> dict:
    """Who made a demonstration and how: the teacher (reference, digest of its files' manifest,
    tokenizer), the sampling parameters, budget, environment, verifier and seed."""
    return {
        "teacher": cfg.teacher,
        "teacher_sha256": _digest(path),
        "tokenizer": tok.fingerprint() if hasattr(tok, "fingerprint") else None,
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "engine": cfg.engine},
        "budget": {"max_context": cfg.max_context, "max_turn_tokens": cfg.max_turn_tokens, "max_turns": cfg.max_turns},
        "env": cfg.env,
        "verifier": cfg.verifier,
        "seed": ctx.seed,
        "stage": ctx.name,
    }


def endpoint_teacher(ctx, cfg: Config) -> tuple[ChatEndpoint, object, dict]:
    """(the endpoint, the student's tokenizer, provenance) of an endpoint teacher; refused (UserError
    naming the key) before any episode when it cannot be reached or does not serve the model."""
    key = f"stages.{ctx.name}"
    path = ctx.checkpoint(cfg.tokenizer, "tokenizer")
    _fits(path, cfg, key, "student")  # the episodes are the student's to train on: its context counts
    _, tok = open_model_dir(path)
    if tok is None:
        raise UserError(f"{key}.tokenizer: {cfg.tokenizer!r} has no tokenizer.json")
    e = cfg.endpoint
    endpoint = ChatEndpoint(
        e.url,
        e.model,
        api_key_env=e.api_key_env,
        timeout_s=e.timeout_s,
        retries=e.retries,
        backoff_s=e.backoff_s,
        concurrency=e.concurrency,
        extra=dict(e.extra),
        key=f"{key}.endpoint",
    )
    identity = endpoint.check()
    provenance = {
        "teacher": f"{e.model} at {endpoint.url}",
        "teacher_sha256": None,  # no files of ours: the endpoint's identity stands for them
        "endpoint": {"url": endpoint.url, "model": e.model, "identity": identity},
        # what the demonstration's tokens are: the endpoint's text encoded by the student's tokenizer
        "tokens": "re-tokenised endpoint text",
        "tokenizer": tok.fingerprint() if hasattr(tok, "fingerprint") else None,
        "tokenizer_ref": cfg.tokenizer,
        "sampling": {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "engine": "endpoint",
            "extra": dict(e.extra),
        },
        "budget": {"max_context": cfg.max_context, "max_turn_tokens": cfg.max_turn_tokens, "max_turns": cfg.max_turns},
        "env": cfg.env,
        "verifier": cfg.verifier,
        "seed": ctx.seed,
        "stage": ctx.name,
    }
    return endpoint, tok, provenance


def shard_tasks(tasks: list, cfg: Config) -> list[tuple[int, object]]:
    """(index in the split, task) of this unit's share: the shard-th of N contiguous blocks (the played
    tasks alternate between domains, so every block holds each domain)."""
    shards = len(cfg.fan_out.get("shard", [0])) if hasattr(cfg, "fan_out") else 1
    lo, hi = cfg.shard * len(tasks) // shards, (cfg.shard + 1) * len(tasks) // shards
    return list(enumerate(tasks))[lo:hi]


def _fits(path: Path, cfg: Config, key: str, who: str) -> None:
    limit = load_model_config(path).max_position_embeddings
    if cfg.max_context + cfg.max_turn_tokens > limit:
        raise UserError(
            f"{key}.max_context: max_context + max_turn_tokens ({cfg.max_context + cfg.max_turn_tokens}) "
            f"exceeds the {who}'s max_position_embeddings ({limit})"
        )


def relay_player(ctx, cfg: Config, teacher_engine, teacher_tok, provenance: dict):
    """With a student: (its tokenizer, which the episodes are rendered in, and a function of the
    loop's (observations, env) giving `play`'s relay), with the student's provenance added."""
    path = ctx.checkpoint(cfg.student, "student")
    _fits(path, cfg, f"stages.{ctx.name}", "student")
    engine, tok, _ = serve_checkpoint(ctx, cfg.student, "student", cfg.batch_size)
    same = tok.fingerprint() == teacher_tok.fingerprint()
    provenance["relay"] = {
        "student": cfg.student,
        "student_sha256": _digest(path),
        "student_tokenizer": tok.fingerprint(),
        "takeover_points": list(cfg.takeover),
        "context_margin_tokens": cfg.context_margin_tokens,
        "teacher_reads": "ids" if same else "text",  # the teacher shares the student's tokenizer, or reads text
    }

    def relay(observations, env):
        teacher = (
            teacher_engine
            if same
            else TextTeacher(teacher_engine, teacher_tok, student_tok=tok, observations=observations, env=env)
        )
        return engine, teacher, tuple(cfg.takeover), cfg.context_margin_tokens

    return tok, relay


def run(ctx) -> dict:
    cfg: Config = ctx.config
    key = f"stages.{ctx.name}"
    if cfg.tasks not in ctx.inputs:
        raise UserError(f"{key}.tasks: stage {cfg.tasks!r} is not in needs")
    tasks = load_tasks(ctx.inputs[cfg.tasks], "train")  # never a held-out split
    tasks = domains_in_turn(tasks, cfg.limit) if cfg.limit > 0 else tasks
    if cfg.endpoint.url:
        engine, tok, provenance = endpoint_teacher(ctx, cfg)
    else:
        path = ctx.checkpoint(cfg.teacher, "teacher")
        _fits(path, cfg, key, "teacher")
        engine, tok, _ = serve_checkpoint(ctx, cfg.teacher, "teacher", cfg.batch_size)
        provenance = teacher_provenance(ctx, cfg, path, tok)
    relay = None
    if cfg.student:  # the episodes are the student's: rendered in its tokenizer
        tok, relay = relay_player(ctx, cfg, engine, tok, provenance)
    out = Path(ctx.out_dir)
    partial = out / "partial"
    partial.mkdir(exist_ok=True)
    if cfg.verifier_timeout_s:
        verifier = TimedVerifier(cfg.verifier, cfg.verifier_timeout_s)
    else:
        verifier = load_verifier(cfg.verifier, f"{key}.verifier")

    def passed_only(task, text):  # full credit only: partial credit of 1.0 that did not pass is no success
        verdict = verifier(task, text)
        return dataclasses.replace(verdict, reward=float(verdict.passed))

    try:
        mine = shard_tasks(tasks, cfg)
        records, trajs = play(
            engine, tok, mine, cfg, ctx.seed, passed_only, provenance, partial, ctx.checkpoint_due, ctx.progress, relay
        )
    finally:
        getattr(verifier, "close", lambda: None)()
    writer = TrajectoryWriter(
        out / DIRNAME, stage=ctx.name, env=cfg.env, keep=keep_trajectories(cfg.keep_trajectories), seed=ctx.seed
    )
    label = f"shard_{cfg.shard}" if ctx.config.fan_out else "teacher"
    writer.write(label, trajs, tok, checkpoint=provenance["teacher"], tasks={t.task_id: t for _, t in mine})
    demos, counts = demonstrations(records, cfg.keep, provenance)
    atomic_write_text(out / DEMOS, "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in demos))
    domains = sorted({r["domain"] for r in records})
    per_domain = {
        d: {
            "episodes": sum(r["domain"] == d for r in records),
            "verified": sum(r["domain"] == d and r["passed"] for r in records),
            "kept": sum(x["domain"] == d for x in demos),
        }
        for d in domains
    }
    # the teacher's digest here too, not only in each demonstration: a stage that kept none still says whose
    summary = {
        "teacher": provenance["teacher"],
        "teacher_sha256": provenance["teacher_sha256"],
        "shard": cfg.shard,
        "keep": cfg.keep,
    }
    if "endpoint" in provenance:
        summary |= {"endpoint": provenance["endpoint"], "tokens": provenance["tokens"], "tokenizer_ref": cfg.tokenizer}
    summary |= {**counts, "domains": per_domain}
    if cfg.student:
        summary |= {"student": cfg.student, "student_sha256": provenance["relay"]["student_sha256"]}
    atomic_write_json(out / "teacher.json", summary)
    shutil.rmtree(partial)  # everything it held is in demos.jsonl, trajectories/ and teacher.json
    takeovers = counts.pop("takeovers", {})
    return {
        **counts,
        "pass_rate": counts["verified"] / max(1, counts["episodes"] - counts["infra_failures"]),
        **{f"{d}/kept": v["kept"] for d, v in per_domain.items()},
        **{f"takeover/{p}": n for p, n in takeovers.items()},
    }
