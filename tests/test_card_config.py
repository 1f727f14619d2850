"""The card's license, intended use and limitations come from the config's `card:` section and land
in the model-card metadata the Hugging Face Hub reads (read back with huggingface_hub); unset stays
"not recorded"; the older top-level keys of frozen configs still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from snowcat.pipeline import cli, config
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import sha256_file
from snowcat.pipeline.reports.card import build_card, training
from snowcat.pipeline.rundir import RunDir

CONFIG = """\
name: crd
stages:
  tasks: {kind: tasks}
"""


def make_run(tmp_path: Path, overrides: list[str] = ()) -> RunDir:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return RunDir.create(config.load(path, list(overrides)), tmp_path / "run")


def checklist(card: str) -> dict[str, str]:
    table = card.split("## Record checklist")[1]
    rows = [cells for line in table.splitlines() if len(cells := line.split("|")) == 4]
    return {cells[1].strip(): cells[2].strip() for cells in rows[2:]}


def test_the_card_section_lands_in_the_hub_metadata_and_the_text(tmp_path):
    run = make_run(
        tmp_path,
        [
            "card.license=apache-2.0",
            "card.intended_use=research on post-training recipes",
            "card.limitations=[trained on synthetic tasks only,not evaluated for safety]",
        ],
    )
    text = build_card(run)
    hub = ModelCard(text)  # how the Hub's own client reads a model card
    assert hub.data.license == "apache-2.0" and hub.data.library_name == "transformers"
    assert hub.data.to_dict()["snowcat"]["intended_use"] == "research on post-training recipes"
    assert "- Intended use: research on post-training recipes\n- License: apache-2.0" in text
    limits = text.split("## Known limitations\n\n")[1].split("\n\n")[0].splitlines()
    assert limits[:2] == [
        "- trained on synthetic tasks only (stated in the config)",
        "- not evaluated for safety (stated in the config)",
    ]
    assert len(limits) > 2  # the recorded ones follow
    rows = checklist(text)
    assert rows["license"] == "apache-2.0" and rows["intended use"] == "research on post-training recipes"


def test_a_license_the_hub_does_not_know_is_other_with_its_name_and_link(tmp_path):
    run = make_run(tmp_path, ["card.license=other", "card.license_name=lab-research-1.0", "card.license_link=LICENSE"])
    data = ModelCard(build_card(run)).data
    assert (data.license, data.license_name, data.license_link) == ("other", "lab-research-1.0", "LICENSE")


def test_unset_is_not_recorded_and_no_license_is_guessed(tmp_path):
    text = build_card(make_run(tmp_path))
    assert "license" not in ModelCard(text).data.to_dict()
    assert "- Intended use: not recorded\n- License: not recorded" in text
    rows = checklist(text)
    assert rows["license"] == "not recorded" and rows["intended use"] == "not recorded"


def test_an_older_runs_frozen_top_level_license_still_loads_into_the_card(tmp_path):
    run = make_run(tmp_path)
    frozen = run.path / "config.yaml"
    text = frozen.read_text()
    card_block = text[text.index("card:\n") : text.index("notify:\n")]
    # as snowcat froze configs before the `card:` section: license and intended_use at the top level
    old = text.replace(card_block, "").replace("description: ''\n", "description: ''\nlicense: mit\nintended_use: research\n")
    frozen.write_text(old)
    info = json.loads((run.path / "run.json").read_text())
    (run.path / "run.json").write_text(json.dumps(info | {"config_sha256": sha256_file(frozen)}))  # a run made so
    run = RunDir.open(run.path)
    assert run.config().card.license == "mit" and "license" not in run.config()
    rows = checklist(build_card(run))
    assert rows["license"] == "mit" and rows["intended use"] == "research"


def test_bad_card_config_is_one_line_naming_the_key(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG + "license: mit\ncard: {license: apache-2.0}\n")
    with pytest.raises(UserError, match=r"run.yaml: license: the older spelling of card.license, which is set too, to another"):
        config.load(path)
    path.write_text(CONFIG)
    for override, error in (
        ("card.license=Apache", r"card.license: 'Apache' is not a Hub license identifier \(lower case"),
        ("card.license=other", r"card.license_name: license: other needs license_name and license_link"),
        ("card.license_link=LICENSE", r"card.license_link: only with license: other"),
        ("card.limitations=['']", r"card.limitations\[0\]: is empty"),
    ):
        with pytest.raises(UserError, match=error):
            config.load(path, [override])
    assert cli.main(["config", str(path), "card.license=GPL v3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "card.license: 'GPL v3' is not a Hub license identifier" in err


def test_an_endpoint_teacher_is_named_by_what_the_service_said_not_by_a_digest():
    record = {
        "teacher": "tiny-teacher at http://node1:8000/v1",
        "teacher_sha256": None,
        "endpoint": {
            "url": "http://node1:8000/v1",
            "model": "tiny-teacher",
            "identity": {"id": "tiny-teacher", "owned_by": "vllm"},
        },
    }
    line = training._named([record], "teacher")
    assert "`tiny-teacher at http://node1:8000/v1`" in line and "OpenAI-compatible endpoint" in line
    assert '{"id": "tiny-teacher", "owned_by": "vllm"}' in line and "re-tokenised" in line and "sha256" not in line
    checkpoint = {"teacher": "sft:final", "teacher_sha256": "ab" * 32}
    assert training._named([checkpoint], "teacher") == f"`sft:final`, files' manifest sha256 `{'ab' * 32}`"
