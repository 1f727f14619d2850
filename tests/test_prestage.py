"""prestage stage and offline checks, with local files and a local wheel directory (no network)."""

import hashlib
import os
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from snowcat.pipeline import offline
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages import prestage


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


def make_ctx(tmp_path: Path, section) -> StageContext:
    out = tmp_path / "run" / "stages" / "prestage"
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(name="prestage", kind="prestage", config=section, run_config=None,
                        run_dir=tmp_path / "run", out_dir=out, inputs={}, seed=0)


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


def section(staging, artefacts):
    cfg = OmegaConf.structured(prestage.Config(staging_dir=str(staging), artefacts=[prestage.Artefact(**a) for a in artefacts]))
    prestage.validate(cfg, "stages.prestage")
    return cfg


def test_prestage_stages_files_dirs_and_wheels(tmp_path, sources):
    staging = tmp_path / "staging"
    data_sha = hashlib.sha256(sources["data"].read_bytes()).hexdigest()
    cfg = section(staging, [
        {"kind": "model", "name": "org/tiny-model", "path": str(sources["model"])},
        {"kind": "dataset", "name": "tasks", "url": sources["data"].as_uri(), "sha256": data_sha},
        {"kind": "wheel", "name": "demo-pkg==1.0", "find_links": str(sources["wheels"])},
    ])
    metrics = prestage.run(make_ctx(tmp_path, cfg))
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
    again = prestage.run(make_ctx(tmp_path, cfg))
    assert again["fetched"] == 0
    assert offline.load_index(staging) == index


def test_prestage_rejects_bad_sources_naming_the_artefact(tmp_path, sources):
    staging = tmp_path / "staging"
    with pytest.raises(UserError, match="'tasks': sha256"):
        prestage.run(make_ctx(tmp_path, section(staging, [
            {"kind": "dataset", "name": "tasks", "path": str(sources["data"]), "sha256": "0" * 64}])))
    assert "tasks" not in offline.load_index(staging)
    assert not (staging / "dataset" / "tasks").exists()  # nothing half-staged
    with pytest.raises(UserError, match="'gone': path .* does not exist"):
        prestage.run(make_ctx(tmp_path, section(staging, [{"kind": "file", "name": "gone", "path": str(tmp_path / "nope")}])))
    with pytest.raises(UserError, match="'nowheel==9': pip download failed"):
        prestage.run(make_ctx(tmp_path, section(staging, [
            {"kind": "wheel", "name": "nowheel==9", "find_links": str(sources["wheels"])}])))
    with pytest.raises(UserError, match=r"artefacts\[0\].kind: 'weights'"):
        section(staging, [{"kind": "weights", "name": "x", "path": "/x"}])
    with pytest.raises(UserError, match=r"artefacts\[1\].name: 'a' listed twice"):
        section(staging, [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}])


def test_offline_stage_with_missing_artefact_fails_before_work(tmp_path, sources, monkeypatch):
    staging = tmp_path / "staging"
    prestage.prestage(staging, [OmegaConf.structured(prestage.Artefact(kind="model", name="org/tiny-model",
                                                                       path=str(sources["model"])))])
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


def test_runner_hook_checks_a_stage_configured_offline(tmp_path, sources, monkeypatch):
    """`offline.prepare(ctx)`: the stage section lists `staged:`; the run's prestage stage says where."""
    for key in [*offline.OFFLINE_ENV, "HF_HOME"]:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    staging = tmp_path / "staging"
    run_config = OmegaConf.create({
        "site": {"internet_on_compute": False},
        "stages": {"stage_in": {"kind": "prestage", "staging_dir": str(staging),
                                "artefacts": [{"kind": "model", "name": "org/tiny-model", "path": str(sources["model"])}]},
                   "sft": {"kind": "sft", "staged": ["org/tiny-model", "org/tokenizer"]}},
    })
    prestage.prestage(staging, run_config.stages.stage_in.artefacts)
    ctx = StageContext(name="sft", kind="sft", config=run_config.stages.sft, run_config=run_config,
                       run_dir=tmp_path, out_dir=tmp_path / "out", inputs={}, seed=0)
    with pytest.raises(UserError, match="'org/tokenizer' is not staged"):
        offline.prepare(ctx)
    assert "HF_HUB_OFFLINE" not in os.environ
    ctx.config = OmegaConf.create({"kind": "sft", "staged": ["org/tiny-model"]})
    assert set(offline.prepare(ctx)) == {"org/tiny-model"} and os.environ["HF_HUB_OFFLINE"] == "1"
