"""Golden batch scripts: every job a submission would send, per site profile, compared with the checked-in
scripts in tests/golden/sbatch/<site>/ (no cluster needed; the way submitit tests its sbatch rendering).

A change to rendering shows up here as a diff to review. After checking a deliberate change by reading
the diff, regenerate with `SNOWCAT_UPDATE_GOLDEN=1 pytest tests/test_golden_scripts.py`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from snowcat.pipeline import config, dag
from snowcat.pipeline.rundir import RunDir
from snowcat.slurm.executor import SlurmExecutor
from snowcat.slurm.site import list_sites
from tests.conftest import write_config

GOLDEN = Path(__file__).parent / "golden" / "sbatch"
RUN_DIR = Path("/runs/golden")  # never created: the dry run only renders

# One of each kind of job: a CPU stage, a GPU stage in a container with continuations, a fan-out, and
# a hetjob whose roles run in their own images (Slurm's MPMD step).
PIPELINE = """
name: golden
seed: 1
stages:
  tasks:
    kind: tasks
    resources: {time_min: 30}
  sft:
    kind: sft
    needs: [tasks]
    image: /images/trainer-{cpu_arch}.sif
    resources: {nodes: 2, tasks_per_node: 1, time_min: 60}
    resume: {max_continuations: 1}
  more:
    kind: tasks
    needs: [tasks]
    fan_out: {replica: [a, b, c]}
    resources: {time_min: 30}
    resume: {strategy: none}
  rl:
    kind: rl
    needs: [tasks, sft]
    init_from: sft:final
    resources:
      time_min: 60
      components:
        trainer: {nodes: 1, tasks_per_node: 1, image: /images/trainer.sif}
        rollout: {nodes: 1, tasks_per_node: 1, image: /images/rollout.sif}
    resume: {max_continuations: 1}
"""


def _scripts(site: str, tmp_path: Path) -> dict[str, str]:
    cfg = config.load(write_config(tmp_path / "golden.yaml", PIPELINE), ["executor.kind=slurm", "site.account=proj"], site=site)
    graph = dag.build(cfg)
    out = tmp_path / "scripts"
    out.mkdir()
    SlurmExecutor(RunDir(RUN_DIR), graph, cfg).dry_run(list(graph.order), out)
    return {p.name: p.read_text().replace(sys.executable, "PYTHON") for p in sorted(out.glob("*.sbatch"))}


@pytest.mark.parametrize("site", list_sites())
def test_batch_scripts_match_the_golden_ones(site, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")  # site local: no cluster needed to render
    for var in ("SCRATCH", "WORK", "PROJECT"):
        monkeypatch.setenv(var, f"/{var.lower()}/alice")  # the scripts do not depend on who renders them
    scripts = _scripts(site, tmp_path)
    folder = GOLDEN / site
    if os.environ.get("SNOWCAT_UPDATE_GOLDEN") == "1":
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.sbatch"):
            old.unlink()
        for name, text in scripts.items():
            (folder / name).write_text(text)
    golden = {p.name: p.read_text() for p in sorted(folder.glob("*.sbatch"))}
    assert sorted(scripts) == sorted(golden), f"{site}: jobs differ; regenerate after review (see module docstring)"
    for name, text in scripts.items():
        assert text == golden[name], f"{site}/{name} differs from tests/golden/sbatch/{site}/{name}"
