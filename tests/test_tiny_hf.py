"""`snowcat tiny-hf --heads/--kv-heads`: a small random checkpoint whose attention Megatron can split
over tensor-parallel ranks (configs/north-star.yaml trains one under TP2). Nothing is trained here:
the layout checks that refuse or accept TP read the checkpoint's config.json."""

from __future__ import annotations

import json

import pytest

from snowcat.pipeline import cli
from snowcat.stages.model import tiny_hf
from snowcat.stages.model.hf import model_config_from_hf, read_hf_config
from snowcat.stages.model.layout import Layout

CONFIG = """\
name: tiny-hf-tp
executor: {{kind: slurm}}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {{count: 20, val_count: 4, difficulties: [2]}}
  sft:
    kind: sft
    needs: [tasks]
    model: "hf:{model}"
    backend: megatron
    tensor_parallel: 2
    seq_len: 128
    batch_rows: 4
    steps: 2
    resources: {{tasks_per_node: 2}}
"""


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "qwen3_moe_tp"
    assert tiny_hf.main([str(out), "--kv-heads", "2"]) == 0
    return out


def test_kv_heads_option_writes_them_and_megatron_layout_accepts_tp2(tp_checkpoint, tmp_path, capsys):
    hf = read_hf_config(tp_checkpoint)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (2, 2, 32)
    model = model_config_from_hf(hf, str(tp_checkpoint))
    assert list(Layout(tensor=2).problems(model, world_size=2)) == []  # the backend's check at load
    # the 1-KV-head default is refused TP2 by the same check
    assert [k for k, _ in Layout(tensor=2).problems(model_config_from_hf({**hf, "num_key_value_heads": 1}, "x"), 2)] == [
        "tensor_parallel"
    ]

    cfg = tmp_path / "run.yaml"  # the planner's check, before submission (what refused the north star's TP2)
    cfg.write_text(CONFIG.format(model=tp_checkpoint))
    assert cli.main(["plan", str(cfg), "--site", "local"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    one_kv = tmp_path / "one_kv"
    one_kv.mkdir()
    (one_kv / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": 1}))
    cfg.write_text(CONFIG.format(model=one_kv))
    assert cli.main(["plan", str(cfg), "--site", "local"]) == 2
    assert "stages.sft.tensor_parallel: 2 does not divide the attention heads (2) and KV heads (1)" in capsys.readouterr().err


def test_heads_must_be_a_multiple_of_kv_heads(tmp_path):
    with pytest.raises(SystemExit):
        tiny_hf.main([str(tmp_path / "bad"), "--heads", "3", "--kv-heads", "2"])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        tiny_hf.tiny_checkpoint(tmp_path / "bad2", ["hello"], heads=2, kv_heads=4)
