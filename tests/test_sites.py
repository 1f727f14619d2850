"""Site profiles load and validate; requests a site cannot run are refused; rendered sbatch options
never contain an option the site rejects."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snowcat.pipeline import config
from snowcat.pipeline.errors import UserError
from snowcat.slurm.site import (
    SITES_DIR,
    default_site,
    env_account,
    filter_sbatch_options,
    list_sites,
    load_site,
    validate_request,
)
from tests.conftest import DEMO

EXPECTED = {
    "jsc-juwels-booster",
    "jsc-jureca-dc",
    "jsc-jupiter",
    "tacc-vista",
    "tacc-frontera",
    "tacc-lonestar6",
    "tacc-stampede3",
    "local",
}


def test_every_profile_loads_and_names_its_sources():
    assert EXPECTED <= set(list_sites())
    for name in list_sites():
        site = load_site(name)
        assert site.name == name and site.sources
        assert site.default_partition in site.partitions
        assert all(hasattr(site, key.split(".")[0]) for key in site.unverified), f"{name}: unverified names unknown keys"


def test_profile_by_path_and_unknown_name(tmp_path):
    assert load_site(SITES_DIR / "local.yaml").name == "local"
    with pytest.raises(UserError, match="unknown site 'nowhere'.*local"):
        load_site("nowhere")


def _write(tmp_path, text: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def _profile(
    partition: str = "p: {gpus_per_node: 4, max_nodes: 2, max_time_min: 60}", default: str = "p", extra: str = ""
) -> str:
    return f"name: bad\ndefault_partition: {default}\npartitions:\n  {partition}\n{extra}"


@pytest.mark.parametrize(
    "text, key",
    [
        (_profile(extra="gpus_per_nodes: 4\n"), "gpus_per_nodes"),  # unknown top-level key
        (_profile(partition="p: {gpus: 4}"), "partitions.p.gpus"),  # unknown nested key
        (_profile(extra="arrays_allowed: maybe\n"), "arrays_allowed"),  # wrong type
        (_profile(partition="p: {max_nodes: many}"), "partitions.p.max_nodes"),
        (_profile(extra="gpu_request: ask-nicely\n"), "gpu_request"),  # not an allowed value
        (_profile(default="q"), "default_partition"),
        (_profile(extra="rejected_options: [mem]\n"), "rejected_options"),
        (_profile(partition="p: {max_time_min: 0}"), "partitions.p.max_time_min"),
    ],
)
def test_bad_profile_is_one_line_user_error_naming_file_and_key(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_site(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and f"key {key}" in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, _profile() + "default_partition: p\n")  # duplicate key
    with pytest.raises(UserError, match=f"{path}: .*line 5.*duplicate key default_partition"):
        load_site(path)


def test_missing_required_key_is_named(tmp_path):
    path = _write(tmp_path, "name: bad\npartitions:\n  p: {max_nodes: 1}\n")
    with pytest.raises(UserError, match=f"{path}.*default_partition"):
        load_site(path)


def test_profiles_are_read_only():
    site = load_site("local")
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.partitions["gpu"].gpus_per_node = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.account = "someone-else"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(partition="gh", gpus_per_node=2), "2 GPUs per node requested, nodes have 1"),
        (dict(partition="gh-dev", nodes=9), "9 nodes requested, allowed 1..8"),
        (dict(partition="gh-dev", time_min=121), "walltime 121 min requested, maximum 120"),
        (dict(partition="gpu-a100"), "unknown partition 'gpu-a100'"),
        (dict(array_size=5000), "maximum 1000"),
    ],
)
def test_over_large_requests_are_refused_on_vista(kwargs, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        validate_request(load_site("tacc-vista"), **kwargs)


def test_site_rules_refuse_arrays_hetjobs_and_missing_accounts():
    with pytest.raises(UserError, match="arrays are not allowed"):
        validate_request(load_site("tacc-frontera"), array_size=4)
    with pytest.raises(UserError, match="account is required"):
        validate_request(load_site("jsc-jupiter"), gpus_per_node=4)
    validate_request(load_site("jsc-jupiter"), gpus_per_node=4, nodes=2, time_min=1440, account="myproj", hetjob=True)
    validate_request(load_site("local"), partition="gpu", nodes=2, gpus_per_node=4, time_min=60, array_size=200)


def test_gpu_request_translated_to_the_sites_way():
    ask = {"--gres": "gpu:a100:4", "nodes": 2, "mem": "100G", "export": "ALL"}
    assert filter_sbatch_options(load_site("jsc-juwels-booster"), ask) == {
        "gres": "gpu:4",
        "nodes": 2,
        "mem": "100G",
        "export": "ALL",
    }
    assert filter_sbatch_options(load_site("local"), ask)["gpus-per-node"] == 4
    assert filter_sbatch_options(load_site("tacc-vista"), ask) == {"nodes": 2}  # whole node; --mem/--export refused
    assert filter_sbatch_options(load_site("local"), {"gpus": 8, "-N": 2, "time": None}) == {"nodes": 2, "gpus-per-node": 4}


OPTION_NAMES = [
    "gres",
    "--gres",
    "gpus",
    "-G",
    "gpus_per_node",
    "gpus-per-task",
    "mem",
    "--mem",
    "mem_per_cpu",
    "export",
    "--export",
    "nodelist",
    "-w",
    "exclude",
    "-x",
    "nodes",
    "-N",
    "ntasks-per-node",
    "time",
    "-t",
    "account",
    "partition",
    "signal",
    "requeue",
    "job_name",
]


@settings(max_examples=300, deadline=None)
@given(
    site_name=st.sampled_from(sorted(EXPECTED)),
    options=st.dictionaries(st.sampled_from(OPTION_NAMES), st.integers(1, 8), max_size=10),
)
@pytest.mark.slow
def test_filtered_options_never_contain_a_rejected_option(site_name, options):
    site = load_site(site_name)
    out = filter_sbatch_options(site, options)
    rejected = {o.lstrip("-") for o in site.rejected_options}
    assert not rejected & set(out), f"{site_name} emitted {rejected & set(out)}"
    assert all(not k.startswith("-") and "_" not in k for k in out)
    gpu_keys = {"gres", "gpus", "gpus-per-node", "gpus-per-task"} & set(out)
    assert len(gpu_keys) <= 1 and (not gpu_keys or gpu_keys == {"gres" if site.gpu_request == "gres" else "gpus-per-node"})
    assert filter_sbatch_options(site, out) == out  # idempotent: rendering twice changes nothing


# ----------------------------------------------------------------------- overrides, run root, environment


def _override(tmp_path, text: str, name: str = "site.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_override_file_is_merged_over_its_base(tmp_path):
    """What `snowcat onboard` writes (`base:` + what differs) loads with --site FILE: the base's values
    stay, the override's win, nested partitions key by key; a base may itself be an override."""
    first = _override(
        tmp_path,
        "base: jsc-juwels-booster\naccount: cjsc\nrun_root: /p/project/cjsc/alice/snowcat\n"
        "partitions:\n  booster: {max_nodes: 16}\n",
    )
    site = load_site(first)
    base = load_site("jsc-juwels-booster")
    assert site.name == "jsc-juwels-booster" and site.account == "cjsc" and site.run_root == "/p/project/cjsc/alice/snowcat"
    assert site.partitions["booster"].max_nodes == 16
    assert site.partitions["booster"].gpus_per_node == base.partitions["booster"].gpus_per_node == 4
    assert set(site.partitions) == set(base.partitions) and site.mpi_plugin == "pspmix"
    sub = tmp_path / "mine"
    sub.mkdir()
    second = _override(sub, "base: ../site.yaml\npartitions:\n  develbooster: {max_time_min: 60}\n", "again.yml")
    chained = load_site(second)  # a relative base is relative to the override that names it
    assert chained.account == "cjsc" and chained.partitions["develbooster"].max_time_min == 60

    loop = _override(tmp_path, f"base: {tmp_path / 'loop.yaml'}\naccount: x\n", "loop.yaml")
    with pytest.raises(UserError, match="include themselves"):
        load_site(loop)
    bad = _override(tmp_path, "base: jsc-juwels-booster\npartitions:\n  booster: {gpus: 4}\n", "bad.yaml")
    with pytest.raises(UserError) as err:
        load_site(bad)
    assert str(bad) in str(err.value) and "partitions.booster.gpus" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="unknown site 'atlantis'"):
        load_site(_override(tmp_path, "base: atlantis\n", "nobase.yaml"))
    with pytest.raises(UserError, match="no such file"):
        load_site(tmp_path / "absent.yaml")


def test_a_run_config_composes_the_override_and_the_sites_run_root(tmp_path):
    """--site FILE and `defaults: - site: FILE` (relative to the config) both merge the override over its
    base; the site's run_root is the default beneath the config: a config or override that sets
    run_root wins."""
    override = _override(tmp_path, "base: jsc-juwels-booster\naccount: cjsc\n")
    cfg = config.load(DEMO, site=str(override))
    assert cfg.site.account == "cjsc" and cfg.site.name == "jsc-juwels-booster"
    assert cfg.run_root == "$PROJECT/$USER/snowcat/runs"  # the profile's, not expanded: the CLI expands it
    assert config.load(DEMO, site="local").run_root == "logs"
    assert config.load(DEMO, ["run_root=/elsewhere"], site="jsc-juwels-booster").run_root == "/elsewhere"

    (tmp_path / "exp.yaml").write_text(f"defaults:\n  - {DEMO}\n  - site: ./site.yaml\nname: exp\n")
    composed = config.load(tmp_path / "exp.yaml")
    assert composed.site.account == "cjsc" and composed.run_root == "$PROJECT/$USER/snowcat/runs"
    assert config.names_site(tmp_path / "exp.yaml") and not config.names_site(DEMO)
    (tmp_path / "own.yaml").write_text(f"defaults:\n  - {DEMO}\n  - site: jsc-juwels-booster\nrun_root: /p/scratch/mine\n")
    assert config.load(tmp_path / "own.yaml").run_root == "/p/scratch/mine"  # the config's own run_root wins


def test_site_and_account_defaults_come_from_the_environment():
    assert default_site("tacc-vista", {"SNOWCAT_SITE": "jsc-juwels-booster"}) == "tacc-vista"
    assert default_site(None, {"SNOWCAT_SITE": "jsc-juwels-booster"}) == "jsc-juwels-booster"
    assert default_site(None, {}) is None and default_site(None, {"SNOWCAT_SITE": ""}) is None
    assert env_account({"SBATCH_ACCOUNT": "cjsc"}) == "cjsc" and env_account({}) is None
