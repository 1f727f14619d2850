"""Per-queue limits in the site profiles (with their sources), the checks that use them (co-running
stages, CUDA engines on xpu partitions, doctor against live QoS caps), JSC's unset $PROJECT, the
site-mode configuration of the local cluster, and `snowcat site detect` on recorded Slurm output.
No cluster here: tests/test_site_modes.py runs the site mode for real."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from snowcat.pipeline import cli, doctor
from snowcat.pipeline.errors import UserError
from snowcat.slurm import cluster, detect, limits
from snowcat.slurm.site import engine_problem, list_sites, load_site, unsourced_limits, validate_request

# ------------------------------------------------------------------------------------- profiles


def test_every_partition_limit_names_its_source_or_is_unverified():
    for name in list_sites():
        assert unsourced_limits(load_site(name)) == [], name
    vista = load_site("tacc-vista")
    assert vista.partitions["gh"].sources["max_running_jobs"].startswith("https://github.com/TACC/TACC-Docs/")
    assert "read 2026-12-05" in vista.partitions["gh-dev"].sources["max_submit_jobs"]


@pytest.mark.parametrize(
    "site, partition, values",
    [  # (max_submit_jobs, max_running_jobs, max_nodes_per_user, mem_gb): TACC's qlimits and system tables
        ("tacc-vista", "gh", (40, 20, 192, 116)),
        ("tacc-vista", "gh-dev", (3, 1, 8, 116)),
        ("tacc-vista", "gg", (40, 20, 128, 237)),
        ("tacc-stampede3", "h100", (4, 2, 4, 1000)),
        ("tacc-stampede3", "pvc", (4, 2, 4, 1000)),
        ("tacc-lonestar6", "gpu-a100", (40, 8, 12, 256)),
        ("tacc-lonestar6", "gpu-h100", (4, 1, 1, 384)),
        ("tacc-lonestar6", "development", (3, 1, 8, 256)),
        ("tacc-frontera", "rtx", (36, 15, 32, 128)),
        ("tacc-frontera", "rtx-dev", (2, 2, 2, 128)),
    ],
)
def test_per_queue_limits_as_the_centres_document_them(site, partition, values):
    part = load_site(site).partitions[partition]
    assert (part.max_submit_jobs, part.max_running_jobs, part.max_nodes_per_user, part.mem_gb) == values


def test_accelerator_kind_per_partition_and_cuda_engines_refused_on_xpu():
    s3 = load_site("tacc-stampede3")
    assert s3.partitions["pvc"].accel() == "xpu" and s3.partitions["h100"].accel() == "cuda"
    assert s3.partitions["skx"].accel() == "none" and load_site("local").partitions["gpu"].accel() == "cuda"
    why = engine_problem(s3, "pvc", "vllm")
    assert "engine vllm needs CUDA GPUs" in why and "partition pvc" in why and "xpu" in why
    assert engine_problem(s3, "pvc", "torch") is None and engine_problem(s3, "h100", "vllm") is None
    assert engine_problem(s3, "skx", "vllm") is None  # vLLM's CPU build runs on CPU nodes


def _profile(tmp_path, partition: str, extra: str = ""):
    path = tmp_path / "p.yaml"
    path.write_text(f"name: p\ndefault_partition: q\npartitions:\n  q: {partition}\n{extra}")
    return path


@pytest.mark.parametrize(
    "partition, key",
    [
        ("{gpus_per_node: 0, accelerator: xpu}", "partitions.q.accelerator"),
        ("{gpus_per_node: 4, sources: {mem: somewhere}}", "partitions.q.sources.mem"),
        ("{max_nodes: 8, max_nodes_per_user: 4}", "partitions.q.max_nodes"),
        ("{max_running_jobs: 0}", "partitions.q.max_running_jobs"),
        ("{accelerator: rocm}", "partitions.q.accelerator"),
    ],
)
def test_bad_limit_fields_are_one_line_naming_file_and_key(tmp_path, partition, key):
    path = _profile(tmp_path, partition)
    with pytest.raises(UserError) as err:
        load_site(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value) and f"key {key}" in str(err.value)


def test_a_job_over_the_per_user_node_cap_is_refused(tmp_path):
    site = load_site(_profile(tmp_path, "{max_nodes: 4, max_nodes_per_user: 4}"))
    validate_request(site, nodes=4)
    site = dataclasses.replace(
        site, partitions={"q": dataclasses.replace(site.partitions["q"], max_nodes_per_user=2, max_nodes=2)}
    )
    with pytest.raises(UserError, match="3 nodes requested, allowed 1..2"):
        validate_request(site, nodes=3)


# ---------------------------------------------------------------------- stages that must co-run


def _stage(components: dict[str, tuple[str, int]], engine: str | None = "torch"):
    comps = {role: SimpleNamespace(partition=p, nodes=n) for role, (p, n) in components.items()}
    return SimpleNamespace(engine=engine, resources=SimpleNamespace(partition=None, components=comps, nodes=1))


def test_hetjob_components_must_fit_the_running_and_node_caps_together():
    vista = load_site("tacc-vista")
    why = limits.stage_problem(vista, _stage({"trainer": ("gh-dev", 1), "rollout": ("gh-dev", 1)}))
    assert why == (
        "partition gh-dev: 2 jobs must run together (each component counts), a user may run 1 at once "
        "(site profile tacc-vista: partitions.gh-dev.max_running_jobs)"
    )
    assert limits.stage_problem(vista, _stage({"trainer": ("gh", 4), "rollout": ("gh", 2)})) is None
    # the live QoS is stricter than the profile: it wins, and is named
    live = limits.LiveLimits(partitions={"gh": limits.PartitionLimits(qos="gh", max_jobs=20, max_nodes_per_user=5)})
    why = limits.stage_problem(vista, _stage({"trainer": ("gh", 4), "rollout": ("gh", 2)}), live)
    assert (
        why == "partition gh: 6 nodes must be held together, a user may hold 5 (sacctmgr: QoS gh of partition gh MaxTRESPU node)"
    )
    s3 = load_site("tacc-stampede3")
    assert "needs CUDA GPUs" in limits.stage_problem(s3, _stage({"trainer": ("h100", 1), "rollout": ("pvc", 1)}, "vllm"))
    assert limits.stage_problem(s3, _stage({"trainer": ("pvc", 1), "rollout": ("h100", 1)}, "vllm")) is None


def test_qos_node_caps_parse_from_sacctmgr():
    text = "normal|||\ngh|40|20|node=192\ngh-dev|3|1|cpu=72,node=8\n"
    assert limits.parse_qos_nodes(text) == {"normal": None, "gh": 192, "gh-dev": 8}
    assert limits.parse_qos(text)["gh-dev"] == (3, 1)
    parts = limits.partition_limits(
        "PartitionName=gh-dev MaxNodes=8 MaxTime=02:00:00 QoS=gh-dev TotalNodes=2\n",
        "",
        limits.parse_qos(text),
        limits.parse_qos_nodes(text),
    )
    assert (parts["gh-dev"].max_jobs, parts["gh-dev"].max_nodes_per_user) == (1, 8)


# -------------------------------------------------------------------------------------- doctor


def test_doctor_names_a_limit_above_the_live_one_and_a_limit_without_source(tmp_path):
    vista = load_site("tacc-vista")
    live = limits.LiveLimits(
        qos={"gh-dev": (3, 1)},
        partitions={"gh-dev": limits.PartitionLimits(qos="gh-dev", max_submit=3, max_jobs=1, max_nodes_per_user=4)},
    )
    check = doctor.check_running_limits(vista, live)
    assert check.status == doctor.WARN
    assert "partitions.gh-dev.max_nodes_per_user: QoS gh-dev MaxTRESPU node is 4, the profile says 8" in check.detail
    assert check.found["override"] == {"partitions": {"gh-dev": {"max_nodes_per_user": 4}}}
    fine = dataclasses.replace(
        live, partitions={"gh-dev": limits.PartitionLimits(qos="gh-dev", max_jobs=1, max_nodes_per_user=8)}
    )
    assert doctor.check_running_limits(vista, fine).status == doctor.PASS
    assert doctor.check_limit_sources(vista).status == doctor.PASS
    bare = load_site(
        _profile(tmp_path, "{max_nodes: 2, max_running_jobs: 4, sources: {max_nodes: 'https://x (read 2026-12-05)'}}")
    )
    check = doctor.check_limit_sources(bare)
    assert (
        check.status == doctor.WARN and check.detail == "no source for partitions.q.max_time_min, partitions.q.max_running_jobs"
    )


# ------------------------------------------------------------------------------------------ JSC


def test_jsc_without_jutil_says_what_to_run_and_a_dry_run_keeps_placeholders(monkeypatch):
    monkeypatch.delenv("PROJECT", raising=False)
    site = OmegaConf.structured(load_site("jsc-juwels-booster"))
    cfg = OmegaConf.create({"run_root": site.run_root, "site": site})
    with pytest.raises(UserError) as err:
        cli.run_root(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "$PROJECT is not set" in msg and "run jutil env activate -p <project>" in msg
    assert "-A <budget>" in msg
    assert str(cli.run_root(cfg, placeholders=True)).startswith("$PROJECT/")  # nothing expanded to /


# --------------------------------------------------------------------------- cluster site modes


def test_site_mode_of_jsc_juwels_booster_is_rendered_from_its_profile(tmp_path):
    """The JSC mode, configured but not started (the Vista one runs in tests/test_site_modes.py)."""
    mode = cluster.site_mode("jsc-juwels-booster")
    assert mode.partition_names == ("booster", "develbooster") and mode.requeue is False and mode.gpus == 4
    assert mode.partitions[0].startswith("PartitionName=booster Nodes=n[1-2] Default=YES MaxTime=1440 MaxNodes=384")
    assert (
        "OverSubscribe=EXCLUSIVE" in mode.partitions[0] and "AllocNodes" not in mode.partitions[0]
    )  # JSC: sbatch in jobs is fine
    assert mode.qos == ()  # no per-user caps documented: none invented
    assert "job_desc.account == nil" in mode.lua and "jutil env activate -p <project>" in mode.lua
    assert "pn_min_memory" not in mode.lua and "environment" in mode.lua  # --mem is accepted at JSC
    conf = cluster._render(tmp_path, cluster._ports(tmp_path), "pw", mode)
    assert "JobRequeue=0" in conf["slurm.conf"] and "JobSubmitPlugins=lua" in conf["slurm.conf"]
    assert "PartitionName=cpu" not in conf["slurm.conf"] and conf["job_submit.lua"] == mode.lua
    own = cluster._render(tmp_path, cluster._ports(tmp_path), "pw")
    assert "JobRequeue=1" in own["slurm.conf"] and "PartitionName=cpu" in own["slurm.conf"] and "job_submit.lua" not in own


def test_site_mode_of_vista_has_its_qos_caps_and_filter():
    mode = cluster.site_mode("tacc-vista")
    assert cluster.Qos("gh-dev", 3, 1, 8) in mode.qos
    assert cluster.Qos("gh-dev", 3, 1, 8).sacctmgr_set() == [
        "MaxSubmitJobsPerUser=3",
        "MaxJobsPerUser=1",
        "MaxTRESPerUser=node=8",
    ]
    assert "AllocNodes=localhost" in mode.partitions[0] and "QOS=gh" in mode.partitions[0]
    for words in ("--mem is not available", "sbatch is not available on compute nodes", "may not name or exclude nodes"):
        assert words in mode.lua
    with pytest.raises(UserError, match="unknown site 'nowhere'"):
        cluster.up(site="nowhere")  # refused before the cluster is touched


# ----------------------------------------------------------------------------------- site detect

CONFIG = "ClusterName = vista\nMaxArraySize = 1001\nJobRequeue = 0\nMpiDefault = pmix\nAccountingStorageEnforce = associations,limits,qos\nJobSubmitPlugins = lua\n"
PARTS = (
    "PartitionName=gh AllowGroups=ALL AllocNodes=login[1-3] Default=YES QoS=gh MaxNodes=64 MaxTime=2-00:00:00 "
    "OverSubscribe=EXCLUSIVE TotalNodes=600\n"
    "PartitionName=gg AllocNodes=login[1-3] Default=NO QoS=gg MaxNodes=32 MaxTime=2-00:00:00 OverSubscribe=EXCLUSIVE TotalNodes=256\n"
)
NODES = (
    "NodeName=c608-001 Arch=aarch64 CoresPerSocket=72 CPUTot=72 Gres=gpu:h200:1 RealMemory=118784 Sockets=1 Partitions=gh\n"
    "NodeName=c501-001 Arch=aarch64 CoresPerSocket=72 CPUTot=144 Gres=(null) RealMemory=242688 Sockets=2 Partitions=gg\n"
)
QOS = "normal|||\ngh|40|20|node=192\ngg|40|20|node=128\n"


def _runner(answers: dict[str, tuple[int, str]]):
    def run(cmd: list[str]) -> tuple[int, str]:
        key = " ".join(cmd)
        return next((v for k, v in answers.items() if key.startswith(k)), (1, "unexpected"))

    return run


def test_detect_drafts_a_profile_marking_each_field(tmp_path):
    answers = {
        "scontrol show config": (0, CONFIG),
        "scontrol -o show partition": (0, PARTS),
        "scontrol -o show node": (0, NODES),
        "sacctmgr -n -P show qos": (0, QOS),
        "sacctmgr -n -P show user": (0, "A-ccsc\n"),
    }
    draft = detect.detect("vista", _runner(answers), environ={"PATH": "/nonexistent", "WORK": "/work/u"}, today="2026-12-05")
    gh, gg = draft.values["partitions"]["gh"], draft.values["partitions"]["gg"]
    assert (gh["gpus_per_node"], gh["gpu_type"], gh["cpus_per_node"], gh["mem_gb"], gh["cpu_arch"]) == (
        1,
        "h200",
        72,
        116,
        "aarch64",
    )
    assert (gh["max_nodes"], gh["max_time_min"], gh["max_submit_jobs"], gh["max_running_jobs"], gh["max_nodes_per_user"]) == (
        64,
        2880,
        40,
        20,
        192,
    )
    assert gh["sources"]["max_running_jobs"] == "sacctmgr show qos (2026-12-05): QOS gh"
    assert gg["gpus_per_node"] == 0 and gg["cpus_per_node"] == 144 and draft.values["cpu_partition"] == "gg"
    v = draft.values
    assert (v["default_partition"], v["requeue_allowed"], v["exclusive_nodes"], v["sbatch_on_compute"]) == (
        "gh",
        False,
        True,
        False,
    )
    assert (v["max_array_size"], v["account"], v["run_root"], v["mpi_plugin"]) == (1000, "A-ccsc", "$WORK/snowcat/runs", "pmix")
    assert draft.marks["requeue_allowed"].startswith("detected: scontrol show config")
    assert draft.marks["rejected_options"].startswith("to fill") and "rejected_options" in v["unverified"]
    path = detect.write_draft(draft, tmp_path / "vista.yaml")
    assert "rejected_options: []  # to fill: the options the site refuses (JobSubmitPlugins=lua" in path.read_text()
    site = load_site(path)
    assert site.partitions["gh"].max_nodes_per_user == 192 and unsourced_limits(site) == []
    with pytest.raises(UserError, match="exists; choose another -o FILE or pass --force"):
        detect.write_draft(draft, path)


def test_detect_where_slurm_does_not_answer_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(limits, "_sh", lambda cmd, timeout=limits.QUERY_TIMEOUT_S: (127, f"{cmd[0]}: not found"))
    out = tmp_path / "draft.yaml"
    assert cli.main(["site", "detect", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "site detect: `scontrol show config` failed (scontrol: not found)" in " ".join(err.split()) and not out.exists()


@pytest.mark.parametrize(
    "site, overrides, fragment",
    [
        (
            "tacc-vista",
            [
                "stages.rl.resources.components.trainer.partition=gh-dev",
                "stages.rl.resources.components.rollout.partition=gh-dev",
            ],
            "error: stage rl, site tacc-vista: partition gh-dev: 2 jobs must run together (each component counts), a user may run 1",
        ),
        (
            "tacc-stampede3",
            ["stages.rl.resources.components.rollout.partition=pvc"],
            "error: stage rl, site tacc-stampede3: engine vllm needs CUDA GPUs; partition pvc",
        ),
    ],
    ids=["hetjob-over-gh-dev-running-cap", "vllm-on-pvc"],
)
def test_a_run_that_can_never_run_there_is_refused_before_anything_is_written(tmp_path, capsys, site, overrides, fragment):
    run_dir = tmp_path / "run"
    config = str(Path(__file__).resolve().parents[1] / "configs" / "agent-hf.yaml")
    args = ["run", config, "--executor", "slurm", "--site", site, "--run-dir", str(run_dir), *overrides]
    assert cli.main([*args, "--dry-run"]) == 2
    assert fragment in " ".join(capsys.readouterr().err.split()) and not run_dir.exists()
