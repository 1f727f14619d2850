"""Values that cannot work and checkpoint references that can never resolve are refused when the
config loads — before anything is written or submitted — with one line naming the source and key.

Each case runs the real CLI on the demo config (`snowcat run`, local and Slurm executor) and on a
config file that holds the bad value itself, so the line must name that file."""

from __future__ import annotations

import pytest

from tests.conftest import DEMO

BAD = [
    ("stages.sft.steps=0", "stages.sft.steps: must be >= 1, got 0"),
    ("stages.sft.steps=-5", "stages.sft.steps: must be >= 1, got -5"),
    ("stages.sft.lr=-1", "stages.sft.lr: must be > 0"),
    ("stages.sft.batch_rows=-4", "stages.sft.batch_rows: must be >= 1"),
    ("stages.sft.seq_len=-64", "stages.sft.seq_len: must be >= 8"),
    ("stages.eval.limit=-3", "stages.eval.limit: must be >= 0"),
    ("stages.rl.top_p=1.5", "stages.rl.top_p: must be <= 1"),
    ("stages.rl.tis_cap=0", "stages.rl.tis_cap: must be > 0"),
    ("executor.max_parallel=-1", "executor.max_parallel: must be >= 1"),
    ("stages.sft.resources.nodes=0", "stages.sft.resources.nodes: must be >= 1"),
    ("stages.rl.resources.components.rollout.nodes=0", "stages.rl.resources.components.rollout.nodes: must be >= 1"),
    ("stages.tasks.domains.arith.count=-2", "stages.tasks.domains.arith.count: must be >= 2"),
    ("seed=-1", "seed: must be >= 0"),
    # trainer layouts no backend can run
    ("stages.sft.zero_stage=3", "stages.sft.zero_stage: ZeRO-3 needs backend: fsdp or deepspeed"),
    ("stages.sft.backend=fsdp2", "stages.sft.backend"),
    # checkpoint references: a name the stage never writes, a stage not in needs, a stage without checkpoints
    ("stages.rl.init_from=sft:nope", "stages.rl.init_from: 'sft:nope': stage 'sft' (kind sft) writes only"),
    ("stages.eval.checkpoints=[sft:final,sft:nope]", "stages.eval.checkpoints: 'sft:nope'"),
    (
        "stages.export.checkpoint=sft:nope",
        "stages.export.checkpoint: 'sft:nope' names stage 'sft', which is not in stages.export.needs",
    ),
    ("stages.export.checkpoint=rl:nope", "stages.export.checkpoint: 'rl:nope': stage 'rl' (kind rl) writes only"),
    (
        "stages.probe.checkpoint=tasks:final",
        "stages.probe.checkpoint: 'tasks:final': stage 'tasks' (kind tasks) writes no checkpoints",
    ),
    ("stages.probe.checkpoint=final", "stages.probe.checkpoint: 'final' is not '<stage>:<checkpoint>'"),
    ("stages.sft.init_from=tasks:initial", "stages.sft.init_from: 'tasks:initial'"),
    # malformed overrides
    ("stages.sft.needs=[tasks", "override 'stages.sft.needs=[tasks': cannot parse the value"),
]


def _one_line_exit_2(proc, fragment: str, tmp_path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run")]  # no half-built temp dir


@pytest.mark.parametrize("override, fragment", BAD)
def test_bad_override_exits_2_with_one_line_and_writes_nothing(snowcat, tmp_path, override, fragment):
    proc = snowcat("run", DEMO, override, "--run-dir", tmp_path / "run")
    _one_line_exit_2(proc, fragment, tmp_path)
    if not override.startswith("stages.sft.needs"):
        assert proc.stderr.startswith(f"error: override '{override}'")  # the source at fault is named


@pytest.mark.parametrize("override, fragment", [b for b in BAD if "needs=[" not in b[0]][:6])
def test_bad_value_in_a_file_names_the_file(snowcat, tmp_path, override, fragment):
    config = tmp_path / "mine.yaml"
    key, _, value = override.partition("=")
    *parents, leaf = key.split(".")
    nested = f"{leaf}: {value}"
    for parent in reversed(parents):
        nested = f"{parent}:\n" + "\n".join("  " + line for line in nested.splitlines())
    config.write_text(f"defaults: [{DEMO}]\n{nested}\n")
    proc = snowcat("run", config, "--run-dir", tmp_path / "run")
    _one_line_exit_2(proc, fragment, tmp_path)
    assert proc.stderr.startswith(f"error: {config}: ")


def test_bad_value_refused_before_any_slurm_submission(snowcat, tmp_path):
    """The same check guards the Slurm path: nothing is rendered, submitted or recorded (no cluster needed)."""
    proc = snowcat("run", DEMO, "stages.sft.steps=0", "--executor", "slurm", "--site", "local", "--run-dir", tmp_path / "run")
    _one_line_exit_2(proc, "stages.sft.steps: must be >= 1", tmp_path)


def test_overrides_are_accepted_after_options(snowcat, tmp_path):
    proc = snowcat("run", DEMO, "--dry-run", "stages.sft.steps=7", "--run-dir", tmp_path / "run", "seed=3")
    assert proc.returncode == 0, proc.stderr
    shown = snowcat("config", DEMO, "--site", "local", "stages.sft.steps=7", check=True).stdout
    assert "steps: 7" in shown
    refused = snowcat("run", DEMO, "--dry-run", "--bogus")
    assert refused.returncode == 2 and "unrecognized arguments: --bogus" in refused.stderr
