"""The model a stage trains or samples, as the planner sees it: a `ModelConfig` (a preset, or a
Hugging Face `config.json`) and its parameters split the way parallelism splits them.

Torch-free: the planner runs on a login node before anything is submitted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from snowcat.pipeline import offline
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.schema import HF_PREFIX, hub_id, parse_checkpoint_ref
from snowcat.pipeline.sweep import parse_unit_selector
from snowcat.stages.model import hf
from snowcat.stages.model.config import PRESETS, ModelConfig, count_params


@dataclass(frozen=True)
class Arch:
    """A model's shape and its parameter groups (counts, not bytes)."""

    source: str  # the preset name or hf: source it came from
    cfg: ModelConfig

    @cached_property
    def counts(self) -> tuple[int, int]:
        return count_params(self.cfg)

    @property
    def total(self) -> int:
        return self.counts[0]

    @property
    def active(self) -> int:
        return self.counts[1]

    @property
    def moe_layers(self) -> int:
        return sum(self.cfg.is_moe_layer(i) for i in range(self.cfg.num_layers))

    @property
    def expert(self) -> int:
        """One routed expert's parameters (SwiGLU: gate, up, down)."""
        return 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size

    @property
    def experts_total(self) -> int:
        """Every routed expert of every MoE layer: what expert parallelism splits."""
        return self.moe_layers * self.cfg.num_experts * self.expert

    @property
    def embed(self) -> int:
        return self.cfg.vocab_size * self.cfg.hidden_size

    @property
    def head(self) -> int:
        return 0 if self.cfg.tie_word_embeddings else self.embed

    @property
    def dense(self) -> int:
        """Everything but the routed experts (attention, norms, routers, shared and dense MLPs, embeddings)."""
        return self.total - self.experts_total

    @property
    def layer_dense(self) -> float:
        """The non-expert parameters of one decoder layer, on average."""
        return (self.dense - self.embed - self.head - self.cfg.hidden_size) / max(1, self.cfg.num_layers)

    @property
    def matmul_active(self) -> int:
        """Parameters a token multiplies with: the active ones less the embedding lookup (the LM head,
        tied or not, is a matmul)."""
        return self.active - self.embed + (self.embed if self.cfg.tie_word_embeddings else 0)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        c = self.cfg
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes

    def describe(self) -> dict:
        c = self.cfg
        return {
            "source": self.source,
            "params_total": self.total,
            "params_active": self.active,
            "params_experts": self.experts_total,
            "layers": c.num_layers,
            "hidden": c.hidden_size,
            "experts": c.num_experts,
            "experts_per_token": c.experts_per_token,
            "moe_intermediate": c.moe_intermediate_size,
            "heads": c.num_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab": c.vocab_size,
        }


def arch_from_hf_config(path: str | Path, source: str | None = None) -> Arch:
    """The Arch of a Hugging Face config.json (a file, or a directory holding one); an
    architecture the trainer does not support is refused naming the key."""
    path = Path(path).expanduser()
    directory = path if path.is_dir() else path.parent
    if path.is_file() and path.name != hf.CONFIG:
        import json  # noqa: PLC0415 (a file given by another name)

        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable config.json ({e})") from None
    else:
        raw = hf.read_hf_config(directory)
    return Arch(source or f"hf:{directory}", hf.model_config_from_hf(raw, str(path)))


def _staged(run) -> dict[str, str]:
    """hub id -> staged directory, for every prestage stage whose index exists here."""
    found: dict[str, str] = {}
    for stage in run.stages.values():
        if stage.kind == "prestage":
            try:
                index = offline.load_index(stage.staging_dir)
            except UserError:
                continue
            found |= {name: e["_root"] + "/" + e["path"] for name, e in index.items() if e.get("path")}
    return found


def _hf_arch(source: str, key: str, run, model_configs: dict[str, str]) -> Arch:
    """The Arch of an hf: source: `--model-config` given for it (or for every hf: source), the
    local directory, or the staged copy."""
    ref = source.removeprefix(HF_PREFIX)
    given = model_configs.get(source) or model_configs.get(ref) or model_configs.get("*")
    if given:
        return arch_from_hf_config(given, source)
    repo = hub_id(source)
    if repo is None:
        return arch_from_hf_config(Path(ref).expanduser(), source)
    staged = _staged(run).get(repo)
    if staged and (Path(staged) / hf.CONFIG).is_file():
        return arch_from_hf_config(staged, source)
    raise UserError(
        f"{key}: {source}: its config.json is not here (not staged yet); give it with "
        f"--model-config {ref}=PATH/config.json (or a local directory)"
    )


def _source_of(stage, name: str) -> tuple[str, str]:
    """(model source, key) a stage starts from: a preset, an hf: source or a '<stage>:<ckpt>' reference."""
    where = f"stages.{name}"
    kind = stage.kind
    if kind == "sft":
        return (stage.init_from, f"{where}.init_from") if stage.init_from else (stage.model, f"{where}.model")
    if kind == "rl":
        return stage.init_from, f"{where}.init_from"
    if kind == "probe":
        return stage.checkpoint, f"{where}.checkpoint"
    if kind == "teacher":
        return stage.teacher, f"{where}.teacher"
    if kind == "evaluate":
        refs = list(stage.checkpoints) or [str(c) for c in stage.fan_out.get("checkpoint", [])]
        return (refs[0] if refs else ""), f"{where}.checkpoints"
    if kind == "export":
        if stage.checkpoint:
            return stage.checkpoint, f"{where}.checkpoint"
        return "", f"{where}.checkpoint"
    return "", f"{where}"


def stage_arch(run, name: str, model_configs: dict[str, str] | None = None, _seen: tuple[str, ...] = ()) -> Arch:
    """The model stage `name` trains or samples, followed through checkpoint references to the stage
    that made it. Unknown sources are refused naming the key."""
    model_configs = model_configs or {}
    if name in _seen:
        raise UserError(f"stages.{name}: its model refers back to itself ({' -> '.join([*_seen, name])})")
    stage = run.stages[name]
    source, key = _source_of(stage, name)
    if not source and stage.kind == "export":  # the best checkpoint of the needed training stage
        trained = [n for n in stage.needs if run.stages[n].kind in ("sft", "rl")]
        if not trained:
            raise UserError(f"{key}: names no checkpoint and the stage needs no training stage")
        return stage_arch(run, trained[-1], model_configs, (*_seen, name))
    if source.startswith(HF_PREFIX):
        return _hf_arch(source, key, run, model_configs)
    if source in PRESETS:
        return Arch(source, dataclasses.replace(PRESETS[source]))
    try:
        stage_part, _ = parse_checkpoint_ref(source)
        needed, _ = parse_unit_selector(stage_part)
    except ValueError:
        raise UserError(
            f"{key}: {source!r} is not a model the planner knows: a preset ({', '.join(PRESETS)}), "
            "an hf: checkpoint or '<stage>:<checkpoint>'"
        ) from None
    if needed not in run.stages:
        raise UserError(f"{key}: {source!r} names stage {needed!r}, which the config does not have")
    return stage_arch(run, needed, model_configs, (*_seen, name))
