"""Notifications: a one-line summary file per failure (and at the run's end) made from the run's
records, delivered from the login node only, by a real shell command; Slurm's own mail options;
bad config is one line naming the key."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from snowcat.pipeline import cli, config, notify
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import run_unit
from snowcat.pipeline.schema import NotifyConfig

# built at run time so this file holds no credential-shaped literal
PLANTED_TOKEN = "hf_" + "".join("AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"[(5 * i + 1) % 36] for i in range(34))

CONFIG = """\
name: ntf
executor: {kind: local, max_parallel: 1}
notify:
  command: NOTIFY_COMMAND
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 8, val_count: 2, difficulties: [1]}
  sft: {kind: sft, needs: [tasks], model: test-micro, steps: 2}
"""
# the command a user would configure for a file drop; a webhook would be: curl -fsS --data-binary @- "$HOOK_SECRET"
INBOX = "cat >> ../inbox.txt"


def make_run(tmp_path: Path, command: str = INBOX, overrides: list[str] = ()) -> RunDir:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("NOTIFY_COMMAND", json.dumps(command)))
    return RunDir.create(config.load(path, list(overrides)), tmp_path / "run")


def inbox(tmp_path: Path) -> list[str]:
    path = tmp_path / "inbox.txt"
    return path.read_text().splitlines() if path.is_file() else []


def test_a_failed_unit_is_one_line_delivered_once_from_the_login_node(tmp_path, capsys):
    run = make_run(tmp_path)
    assert run_unit(run.path, "sft") == 1  # a real failure through the runner: its input is not done
    assert cli.main(["status", str(run.path)]) == 0
    (line,) = inbox(tmp_path)
    assert line.startswith(f"snowcat {run.run_id}: sft FAILED (attempt 0") and "inputs not done: tasks" in line
    assert line.endswith(f"snowcat status {run.path}")
    assert "notify: command: sent sft.failed.a0.c0" in capsys.readouterr().err
    (event,) = (run.path / "notify" / "events").glob("*.txt")
    assert event.read_text() == line + "\n"
    sent = json.loads((run.path / "notify" / "sent.json").read_text())
    assert sent["sft.failed.a0.c0"]["command"]["delivered"] and sent["sft.failed.a0.c0"]["command"]["tries"][0]["exit_code"] == 0

    assert cli.main(["status", str(run.path), "--json"]) == 0  # another look: nothing new, nothing sent twice
    assert json.loads(capsys.readouterr().out)["run_id"] == run.run_id  # --json stays JSON: notes go to stderr
    assert len(inbox(tmp_path)) == 1

    # the same unit failing again (a new attempt, as the executors count them) is a new event
    run.update_stage("sft", status="failed", attempts=2, error="RuntimeError: CUDA out of memory")
    said = notify.notify(run, log=lambda _: None)
    assert said == [
        "notify: new event notify/events/sft.failed.a2.c0.txt: " + inbox(tmp_path)[1],
        "notify: command: sent sft.failed.a2.c0",
    ]
    assert "sft FAILED (attempt 2): RuntimeError: CUDA out of memory" in inbox(tmp_path)[1]


def test_a_failing_channel_is_retried_at_the_next_look_and_records_no_url_or_secret(tmp_path, monkeypatch):
    hook = "https://hooks.example.org/services/T0/B0/" + "x" * 12
    monkeypatch.setenv("SNOWCAT_HOOK_URL", hook)  # no secret by name: its path is cut from what is recorded
    monkeypatch.setenv("HF_TOKEN", PLANTED_TOKEN)  # a secret by name: redacted wherever it appears
    command = 'echo "could not post to $SNOWCAT_HOOK_URL?k=$HF_TOKEN" >&2; exit 3'
    run = make_run(tmp_path, command)
    run.update_stage(
        "sft", status="failed", attempts=1, job_ids=["4242"], slurm={"reason": f"OOM {PLANTED_TOKEN} https://x.org/a?sig=abc"}
    )
    lines = []
    for _ in range(notify.MAX_TRIES + 1):
        notify.notify(run, log=lines.append)
    tries = json.loads((run.path / "notify" / "sent.json").read_text())["sft.failed.a1.c0"]["command"]["tries"]
    assert [t["exit_code"] for t in tries] == [3] * notify.MAX_TRIES  # then given up: not tried a fourth time
    assert tries[0]["output"] == "could not post to https://hooks.example.org/…"
    assert "(2 left)" in lines[1] and lines[-1].endswith("given up")
    event = (run.path / "notify" / "events" / "sft.failed.a1.c0.txt").read_text()
    assert "sft FAILED (attempt 1, job 4242): OOM <redacted> https://x.org/a?… — snowcat status" in event
    for path in (run.path / "notify").rglob("*"):
        if path.is_file():
            assert PLANTED_TOKEN not in path.read_text() and "/services/" not in path.read_text(), path
    assert PLANTED_TOKEN not in "\n".join(lines)


def test_nothing_is_sent_from_a_compute_node_and_the_login_node_sends_it_later(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    run.update_stage("tasks", status="failed", attempts=1, error="killed")
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # inside a job; the config names no site: no network assumed
    said = notify.notify(run, log=lambda _: None)
    assert said[-1].startswith("notify: inside a Slurm job on a compute node without network: nothing sent")
    assert (run.path / "notify" / "events" / "tasks.failed.a1.c0.txt").is_file() and inbox(tmp_path) == []
    assert not (run.path / "notify" / "sent.json").exists()
    monkeypatch.delenv("SLURM_JOB_ID")
    notify.notify(run, log=lambda _: None)
    assert len(inbox(tmp_path)) == 1 and "tasks FAILED (attempt 1): killed" in inbox(tmp_path)[0]


def test_the_end_of_the_run_is_one_event(tmp_path):
    run = make_run(tmp_path)
    notify.notify(run, log=lambda _: None)
    assert inbox(tmp_path) == []  # nothing happened yet
    for key in ("tasks", "sft"):
        run.unit_dir(Unit(key)).mkdir(parents=True)
        run.mark_done(Unit(key), {"duration_s": 1.0}, {})
    notify.notify(run, log=lambda _: None)
    notify.notify(run, log=lambda _: None)
    assert inbox(tmp_path) == [f"snowcat {run.run_id}: run finished, all 2 stages done — snowcat status {run.path}"]


def test_without_a_channel_status_writes_nothing_and_notify_is_a_file_sink(tmp_path, capsys):
    run = make_run(tmp_path, "")
    run.update_stage("sft", status="failed", attempts=1, error="boom")
    assert cli.main(["status", str(run.path)]) == 0
    assert not (run.path / "notify").exists()  # not configured: status only looks
    assert cli.main(["notify", str(run.path), "--dry-run"]) == 0
    assert "new event notify/events/sft.failed.a1.c0.txt" in capsys.readouterr().out
    assert cli.main(["notify", str(run.path)]) == 0
    assert "nothing new: 1 event(s) recorded" in capsys.readouterr().out
    assert cli.main(["notify", str(run.path), "--test"]) == 2
    assert "names no channel (notify.command, notify.mail_to)" in capsys.readouterr().err


def test_mail_through_the_clusters_mail_command(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, "", ["notify.mail_to=me@example.org"])
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    run.update_stage("sft", status="failed", attempts=1, error="boom")
    said = notify.notify(run, log=lambda _: None)
    assert "notify: mail: sft.failed.a1.c0 not sent (exit 127: mail: not found on this machine)" in said[-1]
    # a stand-in for the login node's mail(1), which this machine lacks: it keeps its arguments and body
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mail = bin_dir / "mail"
    mail.write_text(f'#!/bin/sh\nprintf "%s|" "$@" > {tmp_path}/mail.args\ncat > {tmp_path}/mail.body\n')
    mail.chmod(mail.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert notify.notify(run, log=lambda _: None)[-1] == "notify: mail: sent sft.failed.a1.c0"
    assert (tmp_path / "mail.args").read_text() == f"-s|snowcat {run.run_id}|me@example.org|"
    assert "sft FAILED (attempt 1): boom" in (tmp_path / "mail.body").read_text()
    assert cli.main(["notify", str(run.path), "--test"]) == 0
    assert "test notification" in (tmp_path / "mail.body").read_text()
    assert (tmp_path / "mail.args").read_text() == f"-s|snowcat {run.run_id} (test)|me@example.org|"


def test_slurm_mails_on_the_jobs_that_matter():
    assert notify.sbatch_options(NotifyConfig(), "rl") == {}  # nobody to mail
    cfg = NotifyConfig(slurm_mail_user="me@example.org", slurm_mail_type=["FAIL", "TIME_LIMIT_90"], slurm_stages=["rl"])
    assert notify.sbatch_options(cfg, "rl") == {"mail-type": "FAIL,TIME_LIMIT_90", "mail-user": "me@example.org"}
    assert notify.sbatch_options(cfg, "tasks") == {}
    assert notify.sbatch_options(NotifyConfig(slurm_mail_user="me@example.org"), "tasks") == {
        "mail-type": "FAIL",
        "mail-user": "me@example.org",
    }


@pytest.mark.parametrize(
    "override, error",
    [
        ("notify.events=[failed,stalled]", r"notify.events\[1\]: unknown event 'stalled' \(known: failed, finished\)"),
        ("notify.slurm_mail_type=[FAIL,OFTEN]", r"notify.slurm_mail_type\[1\]: 'OFTEN' is not an sbatch --mail-type"),
        ("notify.mail_to=me", r"notify.mail_to: 'me' is not one mail address"),
        ("notify.slurm_stages=[tasks,rl]", r"notify.slurm_stages\[1\]: no stage 'rl' in this run \(stages: tasks, sft\)"),
        (
            "notify.command='curl --data-binary @- https://hooks.example.org/services/T0/B0/x'",
            r"notify.command: holds the URL https://hooks.example.org/\.\.\.: the config is frozen into the run",
        ),
    ],
)
def test_bad_notify_config_is_one_line_naming_the_key(tmp_path, override, error):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("NOTIFY_COMMAND", json.dumps(INBOX)))
    with pytest.raises(UserError, match=error):
        config.load(path, [override])
    config.load(path, ['notify.command=curl --data-binary @- "$HOOK_SECRET"', "notify.mail_to=me@example.org"])


def test_bad_notify_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("NOTIFY_COMMAND", json.dumps(INBOX)))
    assert cli.main(["config", str(path), "notify.events=[sometimes]"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "notify.events[0]: unknown event 'sometimes'" in err


def test_slurm_mail_lands_in_the_batch_scripts_of_the_stages_asked_for(snowcat):
    demo = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
    proc = snowcat(
        "run", demo, "--executor", "slurm", "--site", "jsc-juwels-booster", "site.account=proj", "--dry-run", "--skip-plan",
        "notify.slurm_mail_user=me@example.org", "notify.slurm_stages=[rl]",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rendered = Path(re.search(r"are in (\S+?);", " ".join(proc.stdout.split())).group(1))
    assert "#SBATCH --mail-user=me@example.org" in (rendered / "rl.sbatch").read_text()
    assert "--mail-user" not in (rendered / "sft.sbatch").read_text()
