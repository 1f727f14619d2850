"""Export: a real tiny run's export loads offline in transformers and matches the trainer; a planted
conversion bug is caught by the stage; the checkpoint choice follows the retention ledger."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import verify_manifest
from snowcat.pipeline.retention import Retention, RetentionPolicy
from snowcat.stages import export
from snowcat.stages.model import PRESETS, load_model_dir
from snowcat.stages.tokenizer import train_tokenizer
from tests.conftest import SHARED_RUN_TIMEOUT_S

# the shared full run (built by the first test that needs it) takes minutes on a busy 2-core machine
pytestmark = pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)


@pytest.mark.slow
def test_export_loads_offline_and_matches_the_trainer(full_run, monkeypatch):
    run_dir = full_run

    out = run_dir / "stages" / "export"
    model_dir = out / "model"
    record = json.loads((out / "export.json").read_text())
    eq = record["equivalence"]
    assert record["source"]["ref"] == "sft:final" and "no retained checkpoint with a metric value" in record["source"]["reason"]
    assert eq["logits_match"] and eq["greedy_match"] and eq["chat_template_match"]
    assert eq["max_abs_dlogit"] <= eq["tolerance"] and eq["transformers_architecture"] == "Qwen3MoeForCausalLM"
    assert verify_manifest(model_dir) == []
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    } <= names
    assert len([n for n in names if n.endswith(".safetensors")]) == 4  # max_shard_mb: 2 of ~7 MB
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]

    # independently of the stage: offline, from local files only, same logits as the trainer's model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ours, _, our_tok = load_model_dir(run_dir / "stages" / "sft" / "checkpoints" / "final")
    ours.eval()
    ids = export.probe_batch(ours.config.vocab_size, 3, 20, seed=123)
    with torch.no_grad():
        delta = (hf(input_ids=ids).logits - ours.logits(ours(ids).hidden)).abs().max().item()
    assert delta <= 1e-4
    msgs = [{"role": "user", "content": "12 + 30 ="}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == our_tok.render_prompt(msgs)


@pytest.mark.slow
def test_a_corrupted_conversion_fails_the_stage(full_run, tmp_path):
    ctx = StageContext.standalone(
        "export",
        dict(probe_rows=2, probe_len=12, max_new_tokens=4, debug_corrupt="transpose_q"),
        run_dir=full_run,
        out_dir=tmp_path / "out",
        inputs={"sft": full_run / "stages" / "sft"},
        seed=5,
    )
    with pytest.raises(RuntimeError, match="inference-equivalence check failed"):
        export.run(ctx)
    eq = json.loads((tmp_path / "out" / "export.json").read_text())["equivalence"]
    assert not eq["logits_match"] and eq["max_abs_dlogit"] > eq["tolerance"]


def test_default_choice_is_the_best_retained_checkpoint(tmp_path):
    ckpts = tmp_path / "rl" / "checkpoints"
    ret = Retention(ckpts, RetentionPolicy(metric="eval/pass@1", keep_best=1, keep_last=1), name="step_{step:06d}")
    for step, value in [(1, 0.2), (2, 0.5), (3, 0.3), (4, 0.1)]:
        (ckpts / f"step_{step:06d}").mkdir(parents=True)
        ret.register(step, {"eval/pass@1": value})
    (ckpts / "final").mkdir()
    path, choice = export.choose_checkpoint({"rl": tmp_path / "rl", "tasks": tmp_path / "tasks"})
    assert path == ckpts / "step_000002" and choice["step"] == 2 and "best retained" in choice["reason"]

    # the best is deleted by hand (not by retention): the best *live* one is exported and the loss is said
    ledger = json.loads((ckpts / "retention.json").read_text())
    ledger["checkpoints"]["2"]["deleted"] = True
    (ckpts / "retention.json").write_text(json.dumps(ledger))
    path, choice = export.choose_checkpoint({"rl": tmp_path / "rl"})
    assert path.name == "step_000004" and "historical best (0.5 at step 2)" in choice["reason"]


def test_converter_refuses_what_qwen3_moe_cannot_express():
    tok = train_tokenizer(["a b c 1 2 3"] * 3, 300)
    with pytest.raises(UserError, match="shared expert"):
        export.hf_config(PRESETS["test-micro"], tok, "float32")


def test_config_errors_name_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stages:\n  sft: {kind: sft}\n  export: {kind: export, needs: [sft], checkpoint: 'rl:best'}\n")
    with pytest.raises(
        UserError, match=r"stages\.export\.checkpoint: 'rl:best' names stage 'rl', which is not in stages\.export\.needs"
    ):
        config_mod.load(path)
    path.write_text("stages:\n  export: {kind: export, debug_corrupt: flip}\n")
    with pytest.raises(UserError, match=r"stages\.export\.debug_corrupt: Invalid value 'flip', expected one of"):
        config_mod.load(path)
    with pytest.raises(UserError, match=r"^stages\.export\.probe_prompts: name at least one prompt$"):
        config_mod.stage_config("export", {"probe_prompts": []})
