"""`snowcat bench profile-top`: a py-spy profile's samples per stage process and function."""

from __future__ import annotations

import json

from snowcat.benchmarks import profile_top

DRIVER = 'process 10:"python snowcat run configs/demo.yaml"'
SFT = 'process 11:"python -P -m snowcat.stages /runs/demo sft"'
RL = 'process 12:"python -P -m snowcat.stages /runs/demo rl"'
MAIN = "<module> (stages/__main__.py:9);run (stages/{}.py:40)"
RAW = "\n".join(
    [
        f"{DRIVER};{SFT};{MAIN.format('sft')};_train (stages/sft.py:300);backward (torch/autograd/__init__.py:10) 60",
        f"{DRIVER};{SFT};{MAIN.format('sft')};_train (stages/sft.py:301);forward (stages/model/modeling.py:5) 30",
        f"{DRIVER};{SFT};{MAIN.format('sft')} 10",
        # a recursive function counts once per sample; two ranks of one stage add up
        f"{DRIVER};{RL};{MAIN.format('rl')};f (x.py:1);f (x.py:1) 20",
        f"{DRIVER};{RL};{MAIN.format('rl')};g (x.py:2) 20",
        # a stage process py-spy did not name: attributed by the stage module it runs
        f"{DRIVER};{MAIN.format('probe')};generate (stages/rollout/engine.py:7) 40",
        "garbage line",
    ]
)


def test_samples_go_to_their_stage_and_each_function_counts_once_per_sample(tmp_path, capsys):
    raw = tmp_path / "demo.txt"
    raw.write_text(RAW + "\n")
    out = tmp_path / "top.json"
    assert profile_top.main([str(raw), "--rate", "10", "--json", str(out)]) == 0
    procs = json.loads(out.read_text())["processes"]
    assert {name: p["cpu_s"] for name, p in procs.items()} == {
        "sft": 10.0,
        "rl": 4.0,
        "probe (in python snowcat run)": 4.0,
    }
    sft = {r["function"]: r["share"] for r in procs["sft"]["inclusive"]}
    assert sft["_train (stages/sft.py)"] == 0.9 and sft["backward (torch/autograd/__init__.py)"] == 0.6
    assert "run (stages/sft.py)" not in sft  # in every sample: the call path, left out
    assert {r["function"]: r["cpu_s"] for r in procs["rl"]["self"]} == {"f (x.py)": 2.0, "g (x.py)": 2.0}
    assert {r["function"]: r["cpu_s"] for r in procs["rl"]["inclusive"]} == {"f (x.py)": 2.0, "g (x.py)": 2.0}
    assert "sft: 10.0 s of samples" in capsys.readouterr().out


def test_a_missing_profile_is_one_line_and_exit_2(tmp_path, capsys):
    assert profile_top.main([str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'none.txt'}: no such file"
