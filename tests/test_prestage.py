"""prestage stage and offline checks, with local files, a local wheel directory and FakeHub (a test
double of the Hugging Face Hub's HTTP API; there is no network here)."""

import dataclasses
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from snowcat.pipeline import config as config_mod
from snowcat.pipeline import offline
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.rundir import RunDir
from snowcat.stages import prestage, sft
from snowcat.stages.config import Artefact
from snowcat.stages.model import load_model_dir
from snowcat.stages.model.tiny_hf import tiny_checkpoint
from tests.conftest import runner_context
from tests.fake_hub import FakeHub


def make_wheel(directory: Path, name="demo_pkg", version="1.0") -> Path:
    """A minimal valid pure-Python wheel, as a site's local wheel mirror would hold."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
        z.writestr(f"{info}/RECORD", "".join(f"{a},,\n" for a in files) + f"{info}/RECORD,,\n")
    return path


def make_ctx(tmp_path: Path, staging: Path, artefacts: list[dict]) -> StageContext:
    """The prestage stage's context, its section typed and checked as a loaded config's is."""
    return StageContext.standalone(
        "prestage", section(staging, artefacts), run_dir=tmp_path / "run", out_dir=tmp_path / "run" / "stages" / "prestage"
    )


@pytest.fixture
def sources(tmp_path):
    model = tmp_path / "src" / "tiny-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 8}\n')
    (model / "model.safetensors").write_bytes(os.urandom(1000))
    data = tmp_path / "src" / "tasks.jsonl"
    data.write_text('{"id": 1}\n')
    wheels = tmp_path / "wheelhouse"
    make_wheel(wheels)
    return {"model": model, "data": data, "wheels": wheels}


def section(staging: Path, artefacts: list[dict]) -> dict:
    return {"staging_dir": str(staging), "artefacts": artefacts}


def test_prestage_stages_files_dirs_and_wheels(tmp_path, sources):
    staging = tmp_path / "staging"
    data_sha = hashlib.sha256(sources["data"].read_bytes()).hexdigest()
    artefacts = [
        {"kind": "model", "name": "org/tiny-model", "path": str(sources["model"])},
        {"kind": "dataset", "name": "tasks", "url": sources["data"].as_uri(), "sha256": data_sha},
        {"kind": "wheel", "name": "demo-pkg==1.0", "find_links": str(sources["wheels"])},
    ]
    metrics = prestage.run(make_ctx(tmp_path, staging, artefacts))
    assert metrics["artefacts"] == 3 and metrics["fetched"] == 3

    index = offline.load_index(staging)
    assert set(index) == {"org/tiny-model", "tasks", "demo-pkg==1.0"}
    paths = offline.require_staged(index, index, deep=True)
    assert (paths["org/tiny-model"] / "model.safetensors").read_bytes() == (sources["model"] / "model.safetensors").read_bytes()
    assert index["tasks"]["sha256"] == data_sha and paths["tasks"].read_text() == '{"id": 1}\n'
    assert paths["demo-pkg==1.0"].name == "demo_pkg-1.0-py3-none-any.whl"
    run_copy = (tmp_path / "run" / "stages" / "prestage" / "staged.json").read_text()
    assert data_sha in run_copy

    # Idempotent: a second run fetches nothing and leaves the index as it was.
    again = prestage.run(make_ctx(tmp_path, staging, artefacts))
    assert again["fetched"] == 0
    assert offline.load_index(staging) == index


def test_prestage_rejects_bad_sources_naming_the_artefact(tmp_path, sources):
    staging = tmp_path / "staging"
    with pytest.raises(UserError, match="'tasks': sha256"):
        prestage.run(
            make_ctx(tmp_path, staging, [{"kind": "dataset", "name": "tasks", "path": str(sources["data"]), "sha256": "0" * 64}])
        )
    assert "tasks" not in offline.load_index(staging)
    assert not (staging / "dataset" / "tasks").exists()  # nothing half-staged
    with pytest.raises(UserError, match="'gone': path .* does not exist"):
        prestage.run(make_ctx(tmp_path, staging, [{"kind": "file", "name": "gone", "path": str(tmp_path / "nope")}]))
    with pytest.raises(UserError, match="'nowheel==9': pip download failed"):
        prestage.run(make_ctx(tmp_path, staging, [{"kind": "wheel", "name": "nowheel==9", "find_links": str(sources["wheels"])}]))


@pytest.mark.parametrize(
    "artefacts,error",
    [
        ([{"kind": "weights", "name": "x", "path": "/x"}], r"stages\.prestage\.artefacts\[0\]\.kind: .*'weights'"),
        ([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}], r"stages\.prestage\.artefacts\[1\]\.name: 'a' listed twice"),
        ([{"path": "/x"}], r"stages\.prestage\.artefacts\[0\]\.name: required"),
        ([{"name": "a", "path": "/x", "url": "file:///x"}], r"stages\.prestage\.artefacts\[0\]: give path or url, not both"),
        ([{"name": "a", "path": "/x", "sha256": "ABC"}], r"stages\.prestage\.artefacts\[0\]\.sha256: expected 64 lowercase hex"),
    ],
    ids=["unknown kind", "name twice", "no name", "path and url", "bad sha256"],
)
def test_bad_artefact_lists_name_the_key(tmp_path, artefacts, error):
    with pytest.raises(UserError, match=f"^{error}"):
        config_mod.stage_config("prestage", section(tmp_path / "staging", artefacts))


ARTEFACTS = "  prestage:\n    kind: prestage\n    artefacts:\n      - {name: m, path: /m%s}\n"


@pytest.mark.parametrize(
    "stages,error",
    [
        (ARTEFACTS % ", colour: red", r"stages\.prestage\.artefacts\[0\]\.colour"),
        (ARTEFACTS % "" + "  tasks:\n    kind: tasks\n    colour: red\n", r"stages\.tasks\.colour"),  # not the artefact's
    ],
    ids=["in an artefact", "in another stage"],
)
def test_a_config_file_with_artefacts_names_the_unknown_key_where_it_is(tmp_path, stages, error):
    path = tmp_path / "run.yaml"
    path.write_text("name: x\nstages:\n" + stages)
    with pytest.raises(UserError, match=f"^{path}: {error}: Key 'colour' not in"):
        config_mod.load(path)


def test_offline_stage_with_missing_artefact_fails_before_work(tmp_path, sources, monkeypatch):
    staging = tmp_path / "staging"
    prestage.prestage(staging, [Artefact(kind="model", name="org/tiny-model", path=str(sources["model"]))])
    for key in [*offline.OFFLINE_ENV, "HF_HOME"]:
        monkeypatch.setenv(key, "")  # recorded, so the test's environment is restored afterwards
        monkeypatch.delenv(key)
    work_done = tmp_path / "work-done"

    def offline_stage(needs):
        # What a compute stage does first thing on a node without internet.
        paths = offline.enter_offline(staging, needs)
        work_done.write_text("trained")
        return paths

    with pytest.raises(UserError) as err:
        offline_stage(["org/tiny-model", "org/tokenizer-not-staged"])
    assert "'org/tokenizer-not-staged' is not staged" in str(err.value)
    assert not work_done.exists() and "HF_HUB_OFFLINE" not in os.environ

    paths = offline_stage(["org/tiny-model"])
    assert work_done.exists() and paths["org/tiny-model"].is_dir()
    assert all(os.environ[k] == "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))
    assert os.environ["HF_HOME"].startswith(str(staging))

    # A staged artefact altered afterwards is caught by a deep check, again naming it.
    (paths["org/tiny-model"] / "config.json").write_text("{}")
    with pytest.raises(UserError, match="'org/tiny-model' .* changed since staging"):
        offline.require_staged(staging, ["org/tiny-model"], deep=True)
    with pytest.raises(UserError, match="'x' is not staged"):
        offline.require_staged(tmp_path / "empty-staging", ["x"])


def online_run_config(tmp_path: Path, sources, monkeypatch, sft_keys: str) -> Path:
    """run.yaml: a prestage stage staging org/tiny-model, and an sft stage with `sft_keys`; no
    offline variables in this process yet. Returns the staging dir."""
    for key in [*offline.OFFLINE_ENV, "HF_HOME"]:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    staging = tmp_path / "staging"
    (tmp_path / "run.yaml").write_text(f"""\
stages:
  stage_in:
    kind: prestage
    staging_dir: {staging}
    artefacts: [{{kind: model, name: org/tiny-model, path: {sources["model"]}}}]
  sft: {{kind: sft, {sft_keys}}}
""")
    return staging


def test_runner_hook_checks_a_stage_configured_offline(tmp_path, sources, monkeypatch):
    """`offline.prepare(ctx)`: the stage section lists `staged:`; the run's prestage stage says where."""
    staging = online_run_config(tmp_path, sources, monkeypatch, "staged: [org/tiny-model, org/tokenizer]")
    cfg = config_mod.load(tmp_path / "run.yaml", ["site.internet_on_compute=false"], site="local")
    run = RunDir.create(cfg, tmp_path / "run")
    ctx = runner_context(run.path, "sft")  # prepare reads the site and the prestage stage: the runner's context
    prestage.prestage(staging, ctx.run_config.stages["stage_in"].artefacts)
    with pytest.raises(UserError, match="'org/tokenizer' is not staged"):
        offline.prepare(ctx)
    assert "HF_HUB_OFFLINE" not in os.environ
    ctx.config = dataclasses.replace(ctx.config, staged=["org/tiny-model"])
    assert set(offline.prepare(ctx)) == {"org/tiny-model"} and os.environ["HF_HUB_OFFLINE"] == "1"


def test_an_hf_hub_source_resolves_to_the_staged_copy_offline_and_is_refused_unstaged(tmp_path, sources, monkeypatch):
    (tmp_path / "bad.yaml").write_text("stages:\n  sft: {kind: sft, model: 'hf:org/tiny-model'}\n")
    with pytest.raises(UserError, match=r"stages\.sft\.model: 'hf:org/tiny-model' is neither a local directory nor staged: add "):
        config_mod.load(tmp_path / "bad.yaml")
    staging = online_run_config(tmp_path, sources, monkeypatch, "needs: [stage_in], model: 'hf:org/tiny-model'")
    run = RunDir.create(config_mod.load(tmp_path / "run.yaml"), tmp_path / "run")
    ctx = runner_context(run.path, "sft")
    with pytest.raises(UserError, match="'org/tiny-model' is not staged"):  # before the prestage stage ran
        offline.prepare(ctx)
    prestage.prestage(staging, ctx.run_config.stages["stage_in"].artefacts)
    ctx.staged = offline.prepare(ctx)  # as the runner does before run(ctx)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    path = ctx.checkpoint("hf:org/tiny-model", "model")
    assert path == ctx.staged["org/tiny-model"] and path.is_relative_to(staging)
    assert ctx.checkpoint(f"hf:{sources['model']}", "model") == sources["model"]  # a local directory as it is


# ---------------------------------------------------------------- hub downloads, against FakeHub (no hub here)


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """A small random Qwen3-MoE checkpoint with its tokenizer, as a hub repo holds one."""
    path = tmp_path_factory.mktemp("tiny-repo")
    tiny_checkpoint(path, ["What is 12+30?", "42", "That is not right. Try again."])
    (path / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return path


@pytest.fixture
def hub(monkeypatch, tiny_repo, tmp_path):
    """FakeHub serving org/tiny with two commits on main (the first pinned by tests), this process's
    huggingface_hub pointed at it and online."""
    with FakeHub() as fake:
        fake.first = fake.push("org/tiny", tiny_repo)
        fake.push("org/tiny", {**_files(tiny_repo), "README.md": b"---\nlicense: apache-2.0\n---\n# tiny, retrained\n"})
        for key in [*offline.OFFLINE_ENV, "HF_HOME"]:
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)
        fake.use_endpoint(monkeypatch, tmp_path / "hf-home")
        yield fake


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("revision", [None, "main", "first"], ids=["no revision", "main", "a pinned commit"])
def test_a_hub_download_records_the_commit_it_resolved_to_and_stages_exactly_it(tmp_path, hub, revision):
    pinned = hub.first if revision == "first" else revision
    head = hub.repos[("model", "org/tiny")]["branches"]["main"]
    expected = hub.first if revision == "first" else head
    # a push between resolving and downloading: the copy must still be one commit, the resolved one
    hub.after_repo_info.append(lambda: hub.push("org/tiny", {"config.json": b"{}"}))
    art = {"kind": "model", "name": "org/tiny"} | ({"revision": pinned} if pinned else {})
    prestage.run(make_ctx(tmp_path, tmp_path / "staging", [art]))

    entry = offline.load_index(tmp_path / "staging")["org/tiny"]
    assert entry["hub"] == {"endpoint": hub.url, "repo_type": "model", "requested_revision": pinned, "revision": expected}
    assert entry["source"] == ({"revision": pinned} if pinned else {})  # the configured source, as before
    assert offline.staged_revision(entry) == expected
    staged = offline.require_staged(tmp_path / "staging", ["org/tiny"], deep=True)["org/tiny"]
    assert _files(staged) == hub.repos[("model", "org/tiny")]["commits"][expected]  # that commit's files, nothing else
    assert hub.fetched_revisions() == {expected}  # every file fetched by the commit, never by the branch name
    run_copy = json.loads((tmp_path / "run" / "stages" / "prestage" / "staged.json").read_text())
    assert run_copy["artefacts"]["org/tiny"]["hub"] == entry["hub"]


@pytest.mark.parametrize(
    "art,error",
    [
        ({"name": "org/absent"}, r"^artefact 'org/absent': no model repo of that name on http://127\.0\.0\.1:\d+ \(or it is"),
        ({"name": "org/tiny", "revision": "v9"}, r"^artefact 'org/tiny': revision 'v9' is not in the model repo on http://"),
        ({"name": "org/tiny", "revision": "f" * 40}, r"^artefact 'org/tiny': revision 'f{40}' is not in the model repo"),
    ],
    ids=["unknown repo", "unknown branch", "unknown commit"],
)
def test_an_unknown_hub_repo_or_revision_is_a_one_line_error_naming_the_artefact(tmp_path, hub, art, error):
    with pytest.raises(UserError, match=error) as err:
        prestage.run(make_ctx(tmp_path, tmp_path / "staging", [{"kind": "model", **art}]))
    assert "\n" not in str(err.value)
    assert art["name"] not in offline.load_index(tmp_path / "staging")
    assert not any((tmp_path / "staging" / "model").iterdir())  # nothing half-staged


def test_a_staged_hub_model_resolves_offline_with_its_commit_in_the_lineage(tmp_path, hub, monkeypatch, tiny_repo):
    staging = tmp_path / "staging"
    (tmp_path / "run.yaml").write_text(f"""\
stages:
  stage_in:
    kind: prestage
    staging_dir: {staging}
    artefacts: [{{kind: model, name: org/tiny, revision: main}}]
  sft: {{kind: sft, needs: [stage_in], model: 'hf:org/tiny'}}
""")
    run = RunDir.create(config_mod.load(tmp_path / "run.yaml"), tmp_path / "run")
    ctx = runner_context(run.path, "sft")
    prestage.prestage(staging, ctx.run_config.stages["stage_in"].artefacts)
    commit = hub.repos[("model", "org/tiny")]["branches"]["main"]
    hub.stop()  # no hub from here on: the compute node's view
    ctx.staged = offline.prepare(ctx)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    path = ctx.checkpoint("hf:org/tiny", "model")
    assert path == ctx.staged["org/tiny"] and path.is_relative_to(staging)
    model, _, tok = load_model_dir(path)  # weights and tokenizer load from the staged copy alone
    assert tok is not None and (path / "model.safetensors").read_bytes() == (tiny_repo / "model.safetensors").read_bytes()
    lineage = sft.lineage(ctx, ctx.config)  # what SFT writes into checkpoints/initial/meta.json, the card's source
    assert lineage["hub_id"] == "org/tiny" and lineage["revision"] == commit and lineage["requested_revision"] == "main"
    assert lineage["license"] == "apache-2.0"


def test_prestage_through_the_cli_reaches_the_hub_named_by_hf_endpoint(tmp_path, hub, snowcat):
    """The real path: `snowcat run` in fresh processes that read HF_ENDPOINT at import. The first
    artefact stages with its commit; the second, unknown, fails the stage naming it, on one line,
    and the index keeps the first."""
    staging = tmp_path / "staging"
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(f"""\
name: hub
executor: {{kind: local, max_parallel: 1}}
stages:
  prestage:
    kind: prestage
    staging_dir: {staging}
    artefacts: [{{kind: model, name: org/tiny}}, {{kind: model, name: org/absent}}]
""")
    proc = snowcat("run", cfg, "--run-dir", tmp_path / "run", env={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")})
    assert proc.returncode == 1  # a failed stage stops the run (as any stage's error does)
    status = snowcat.status(tmp_path / "run")
    error = status["stages"]["prestage"]["error"]
    assert error.startswith("UserError: artefact 'org/absent': no model repo of that name on " + hub.url) and "\n" not in error
    entry = offline.load_index(staging)["org/tiny"]
    assert entry["hub"]["revision"] == hub.repos[("model", "org/tiny")]["branches"][
        "main"
    ] and "org/absent" not in offline.load_index(staging)
