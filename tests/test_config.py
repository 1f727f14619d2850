"""Config composition and validation: one schema, errors naming the source and the key."""

import re
from pathlib import Path

import pytest

from snowcat.pipeline import config
from snowcat.pipeline.errors import UserError
from snowcat.stages.registry import KINDS
from tests.conftest import DEMO, REPO, write_config


def test_demo_loads_typed_and_resolved():
    cfg = config.load(DEMO)
    assert cfg.stages.tasks.kind == "tasks"
    assert cfg.stages.tasks.domains.closure.difficulties == [1, 2, 3, 4, 5, 6]
    assert cfg.stages.tasks.resources.nodes == 1  # common keys come with every stage


def test_overrides_use_dot_paths_and_types():
    cfg = config.load(DEMO, ["seed=7", "stages.tasks.domains.arith.count=100", "stages.tasks.domains.arith.val_count=5"])
    assert cfg.seed == 7 and cfg.stages.tasks.domains.arith.count == 100


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("stages.tasks.bogus=1", "stages.tasks.bogus"),
        ("seed=abc", "seed"),
        ("stages.tasks.resources.nodes=many", "stages.tasks.resources.nodes"),
        ("executor.kind=pbs", "executor.kind"),
        ("stages.tasks.domains.arith.val_count=0", "stages.tasks.domains.arith.val_count"),
        ("stages.tasks.kind=nope", "stages.tasks.kind"),
        ("name=${missing.key}", "name"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(UserError) as e:
        config.load(DEMO, [override])
    message = str(e.value)
    assert fragment in message and "\n" not in message


def test_error_names_the_file(tmp_path):
    bad = write_config(tmp_path / "bad.yaml", "name: x\nstages:\n  t:\n    kind: tasks\n    colour: blue\n")
    with pytest.raises(UserError, match=r"bad\.yaml: stages\.t\.colour"):
        config.load(bad)


def test_missing_required_kind(tmp_path):
    bad = write_config(tmp_path / "bad.yaml", "stages:\n  t:\n    needs: []\n")
    with pytest.raises(UserError, match=r"stages\.t\.kind: missing"):
        config.load(bad)


def test_the_docs_table_of_stage_kinds_is_the_registry():
    """docs/configuration.md's table of stage kinds lists the registry's kinds in its order, each with
    its summary and whether it wants GPUs and resumes (stages/registry.py): a new kind is documented."""
    section = (REPO / "docs" / "configuration.md").read_text().split("\n## Stage kinds\n", 1)[1].split("\n#", 1)[0]
    rows = [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in section.splitlines() if line.startswith("| `")
    ]
    assert [(kind, summary, gpu, resumes) for kind, summary, gpu, resumes, _guide in rows] == [
        (f"`{k.name}`", k.summary, "yes" if k.gpu else "", "yes" if k.resumable else "") for k in KINDS.values()
    ]


def test_missing_file():
    with pytest.raises(UserError, match="not found"):
        config.load(Path("/nonexistent/x.yaml"))


def test_defaults_compose_experiment_and_site(tmp_path):
    write_config(tmp_path / "base.yaml", "seed: 3\nname: base\nstages:\n  tasks:\n    kind: tasks\n")
    exp = write_config(
        tmp_path / "exp.yaml",
        "defaults:\n  - base.yaml\n  - site: local\nname: exp\ndescription: 'seed is ${seed}'\n",
    )
    cfg = config.load(exp)
    assert cfg.name == "exp" and cfg.seed == 3 and cfg.description == "seed is 3"
    assert cfg.stages.tasks.kind == "tasks"
    assert cfg.site.name == "local"


def test_site_option_and_unknown_site():
    assert config.load(DEMO, site="local").site.name == "local"
    with pytest.raises(UserError, match="unknown site 'atlantis'"):
        config.load(DEMO, site="atlantis")


def test_stage_seeds_are_stable_and_distinct():
    assert config.stage_seed(1, "a") == config.stage_seed(1, "a")
    assert (
        len({config.stage_seed(1, "a"), config.stage_seed(1, "b"), config.stage_seed(2, "a"), config.stage_seed(1, "a", 0)}) == 4
    )


def test_rl_rank_layout_problems_are_found_at_load_not_on_the_ranks():
    from snowcat.pipeline.config import stage_config  # noqa: PLC0415

    with pytest.raises(UserError, match=r"^stages\.rl\.transport: mpi needs a world of at least 2 ranks"):
        stage_config("rl", {"transport": "mpi"})
    four_trainers = {"components": {"trainer": {"nodes": 1, "tasks_per_node": 4}, "rollout": {"nodes": 1, "tasks_per_node": 1}}}
    with pytest.raises(
        UserError, match=r"^stages\.rl\.tasks_per_update: 1 tasks x 2 attempts is fewer trajectories .* 4 trainer ranks"
    ):
        stage_config("rl", {"resources": four_trainers, "tasks_per_update": 1, "attempts": 2})
    assert stage_config("rl", {"resources": four_trainers, "tasks_per_update": 2, "attempts": 2}).tasks_per_update == 2
    assert stage_config("rl", {"transport": "mpi", "resources": {"tasks_per_node": 2}}).transport == "mpi"


RL_COMPONENTS = """
name: roles
stages:
  tasks: {kind: tasks}
  sft: {kind: sft, needs: [tasks]}
  rl:
    kind: rl
    needs: [tasks, sft]
    resources:
      components:
"""


@pytest.mark.parametrize(
    "components, given",
    [
        ("        rollout: {tasks_per_node: 1}\n        trainer: {tasks_per_node: 1}\n", "1 rollout rank, then 1 trainer rank"),
        ("        trainer: {tasks_per_node: 2}\n", "2 trainer ranks"),  # no rollout rank
        (
            "        other: {tasks_per_node: 2}\n        trainer: {tasks_per_node: 1}\n",
            "1 trainer rank, then 1 rollout rank, then 1 trainer rank",
        ),
    ],
)
def test_rl_component_order_is_refused_by_snowcat_config(components, given, tmp_path, capsys):
    """Rank order is component order, and the RL stage's ranks must be trainers first, then rollouts:
    `snowcat config` (and so the dry run) refuses the order stages/rl.py would refuse on the ranks."""
    from snowcat.pipeline import cli  # noqa: PLC0415

    path = write_config(tmp_path / "roles.yaml", RL_COMPONENTS + components)
    assert cli.main(["config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "stages.rl.resources.components: rank order is component order" in err and err.endswith(f"got {given}")


@pytest.mark.parametrize(
    "components",
    [
        "        trainer: {tasks_per_node: 1}\n        rollout: {tasks_per_node: 2}\n",
        "        trainer: {tasks_per_node: 1}\n",  # one rank plays both roles
        "        a: {tasks_per_node: 1}\n        b: {tasks_per_node: 2}\n",  # other names: rank 0 trains
    ],
)
def test_rl_components_that_can_run_load(components, tmp_path):
    config.load(write_config(tmp_path / "roles.yaml", RL_COMPONENTS + components))


def test_an_rl_stage_without_its_tasks_stage_in_needs_is_refused_by_snowcat_config(tmp_path, capsys):
    """The task pool comes from the tasks stage (stages/rl.py); without it in `needs` the stage would
    fail on its ranks after the jobs before it ran: `snowcat config` (and the dry run) refuse it."""
    from snowcat.pipeline import cli  # noqa: PLC0415

    text = RL_COMPONENTS.replace("needs: [tasks, sft]", "needs: [sft]") + "        trainer: {tasks_per_node: 1}\n"
    path = write_config(tmp_path / "no-tasks.yaml", text)
    assert cli.main(["config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stages.rl.needs: add 'tasks' (named in tasks_input)" in err, err


def test_an_override_that_sets_a_list_element_by_index_is_one_line_naming_it():
    # omegaconf merges `key.0.field=v` as a mapping, which a list cannot take (it raised a TypeError)
    bad = "stages.prestage.artefacts.0.path=X"
    with pytest.raises(UserError, match=re.escape(f"override '{bad}': sets part of a list by its index")):
        config.load(REPO / "configs" / "hf-tiny.yaml", [bad])
    whole = "stages.tasks.domains.closure.difficulties=[1,2]"  # a whole list is fine
    assert list(config.load(DEMO, [whole]).stages.tasks.domains.closure.difficulties) == [1, 2]
