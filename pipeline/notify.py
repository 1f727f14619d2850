"""Notifications: word when a run needs attention, sent only from where the network is.

Compute nodes at most centres have no network, and nothing runs between a run's jobs. So a
notification is a one-line summary file per event, made from the run directory's records by
whoever looks at the run from the login node (`snowcat status`, `snowcat sync`, `snowcat notify`
— a cron job can call it — and the local executor when a run ends), and delivered from there:

    <run>/notify/events/<id>.txt   one line per event: a unit that failed (per attempt and
                                   continuation), the run finished (every stage done)
    <run>/notify/sent.json         per event and channel: when it was delivered, or each failed try

Channels (config `notify:`, pipeline/schema.py NotifyConfig): `command`, a shell command run once per
new line (the line on stdin and in $SNOWCAT_NOTIFY_LINE; a webhook's URL comes from an environment
variable, never the config); `mail_to`, the cluster's `mail -s SUBJECT ADDRESS`. A failed delivery
is tried again by the next look, up to MAX_TRIES. Inside a Slurm job on a site whose compute nodes
have no network nothing is sent (the files are still written). Slurm's own mail on the jobs that
matter is `sbatch_options` (--mail-type/--mail-user). Every line is scrubbed of credentials, and
what a channel printed is recorded without URLs' paths and queries.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock, Timeout
from omegaconf import OmegaConf

from .config import typed
from .dag import Dag, build
from .errors import UserError
from .fsio import atomic_write_json, atomic_write_text, read_json
from .rundir import RunDir, now
from .schema import NotifyConfig
from .scrub import scrub_text

NOTIFY_DIR = "notify"
EVENTS = "events"
SENT = "sent.json"
MAX_TRIES = 3  # deliveries of one event on one channel before giving up (recorded)
MAX_LINE = 400
TIMEOUT_S = 60
_URL_QUERY = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s?#'\"]+)[?#][^\s'\"]*", re.I)
_URL_TAIL = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s?#'\"]+)[/?#][^\s'\"]*", re.I)


def sbatch_options(cfg: NotifyConfig, stage: str) -> dict[str, str]:
    """Slurm's own mail for the jobs of `stage` (sbatch --mail-type/--mail-user), when the config
    asks for it: Slurm sends it from its controller, which has the mail relay compute nodes lack."""
    if not cfg.slurm_mail_user or (cfg.slurm_stages and stage not in cfg.slurm_stages):
        return {}
    return {"mail-type": ",".join(cfg.slurm_mail_type), "mail-user": cfg.slurm_mail_user}


def configured(cfg: NotifyConfig) -> bool:
    return bool(cfg.events and (cfg.command or cfg.mail_to))


def _one_line(text: str) -> str:
    """One line, credentials redacted, URLs without their query (where tokens travel), shortened."""
    line = _URL_QUERY.sub(r"\1?…", " ".join(scrub_text(str(text)).split()))
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 1] + "…"


def _safe(key: str) -> str:
    return re.sub(r"[^\w.=,-]", "_", key)


def events(run: RunDir, cfg: NotifyConfig, dag: Dag) -> dict[str, str]:
    """{event id: its line} for what the run's records say now (ids are stable: the same failure
    gives the same id at every look)."""
    out: dict[str, str] = {}
    if "failed" in cfg.events:
        keys = [u.key for node in dag for u in node.units] + [n.name for n in dag if n.items is not None]
        for key in keys:
            rec = run.record(key)
            if rec.get("status") != "failed":
                continue
            attempt, cont = rec.get("attempts", 0), rec.get("continuations_used", 0)
            job = (rec.get("job_ids") or [None])[-1] or rec.get("slurm_job_id")
            where = rec.get("node") or rec.get("host")
            said = ", ".join(x for x in (f"attempt {attempt}", job and f"job {job}", where and f"node {where}") if x)
            why = rec.get("error") or (rec.get("slurm") or {}).get("reason") or "no error recorded"
            eid = f"{_safe(key)}.failed.a{attempt}.c{cont}"
            out[eid] = _one_line(f"snowcat {run.run_id}: {key} FAILED ({said}): {why} — snowcat status {run.path}")
    if "finished" in cfg.events and all(run.is_done(u) for node in dag for u in node.units):
        out["run.finished"] = _one_line(
            f"snowcat {run.run_id}: run finished, all {len(dag.nodes)} stages done — snowcat status {run.path}"
        )
    return out


def _frozen_notify(run: RunDir) -> NotifyConfig:
    """The `notify:` section as frozen in config.yaml, read without validating the whole config (an
    older run's config has none: nothing configured)."""
    raw = OmegaConf.to_container(OmegaConf.load(run.path / "config.yaml")).get("notify") or {}
    return NotifyConfig(**{k: v for k, v in raw.items() if k in NotifyConfig.__dataclass_fields__})


def on_compute_node(run_cfg) -> bool:
    """Inside a Slurm job on a site whose compute nodes are not known to have network: send nothing."""
    site = run_cfg.site
    return bool(os.environ.get("SLURM_JOB_ID")) and not (site is not None and site.internet_on_compute is True)


def _channels(cfg: NotifyConfig, run: RunDir, subject: str) -> dict[str, list[str]]:
    out = {}
    if cfg.command:
        out["command"] = ["/bin/sh", "-c", cfg.command]
    if cfg.mail_to:
        out["mail"] = [shutil.which("mail") or "mail", "-s", subject, cfg.mail_to]
    return out


def _send(argv: list[str], line: str, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """(exit code, what it printed, scrubbed: URLs cut to their host). 127: not found."""
    try:
        proc = subprocess.run(
            argv,
            input=line + "\n",
            env=os.environ | env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found on this machine"
    except subprocess.TimeoutExpired:
        return 124, f"did not finish in {TIMEOUT_S} s"
    said = _URL_TAIL.sub(r"\1/…", " ".join(proc.stdout.split()[-40:]))
    return proc.returncode, _one_line(said)[:200]


def notify(run: RunDir, *, deliver: bool = True, explicit: bool = False, log=None) -> list[str]:
    """Write the summary file of every new event and deliver what is not delivered yet; returns one
    line per thing done. Without `explicit` (status, sync, the local executor) nothing happens
    unless the config names a channel. Never raises for a channel that fails (it is recorded)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if not explicit and not configured(_frozen_notify(run)):
        return []  # decided from the frozen file alone: `status` of a run without notifications pays nothing
    frozen = run.config()
    run_cfg = typed(frozen)
    cfg = run_cfg.notify
    root = run.path / NOTIFY_DIR
    (root / EVENTS).mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    try:
        lock = FileLock(str(root / ".lock"), timeout=0)
        lock.acquire()
    except Timeout:
        return []  # another look at the run is delivering now
    try:
        for eid, line in events(run, cfg, build(frozen)).items():
            path = root / EVENTS / f"{eid}.txt"
            if not path.is_file():
                atomic_write_text(path, line + "\n")
                done.append(f"notify: new event {path.relative_to(run.path)}: {line}")
        if not deliver:
            return done
        if on_compute_node(run_cfg):
            done.append("notify: inside a Slurm job on a compute node without network: nothing sent (the login node sends it)")
            return done
        sent = read_json(root / SENT, {}) or {}
        channels = _channels(cfg, run, f"snowcat {run.run_id}")
        for path in sorted((root / EVENTS).glob("*.txt")):
            eid, line = path.stem, path.read_text().strip()
            record = sent.setdefault(eid, {})
            for name, argv in channels.items():
                state = record.setdefault(name, {"tries": []})
                if state.get("delivered") or len(state["tries"]) >= MAX_TRIES:
                    continue
                env = {"SNOWCAT_NOTIFY_LINE": line, "SNOWCAT_NOTIFY_FILE": str(path), "SNOWCAT_NOTIFY_EVENT": eid}
                code, said = _send(argv, line, env | {"SNOWCAT_RUN_DIR": str(run.path)}, run.path)
                state["tries"].append({"at": now(), "exit_code": code} | ({"output": said} if said else {}))
                if code == 0:
                    state["delivered"] = now()
                    done.append(f"notify: {name}: sent {eid}")
                else:
                    left = MAX_TRIES - len(state["tries"])
                    more = f"tried again at the next look ({left} left)" if left else "given up"
                    done.append(f"notify: {name}: {eid} not sent (exit {code}{': ' + said if said else ''}); {more}")
                atomic_write_json(root / SENT, sent)  # after each delivery: a crash never sends one twice
        return done
    finally:
        lock.release()
        for line in done:
            log(line)


def quietly(run: RunDir, log=None) -> None:
    """For `status`, `sync` and the local executor: `notify`, whose own failure is one line, never theirs."""
    try:
        notify(run, log=log)
    except Exception as e:  # noqa: BLE001 (a notification never fails the command that looked)
        (log or (lambda line: print(line, file=sys.stderr, flush=True)))(f"notify: skipped: {type(e).__name__}: {e}")


def send_test(run: RunDir) -> int:
    """Send one test line through every configured channel now (nothing recorded as an event)."""
    run_cfg = typed(run.config())
    cfg = run_cfg.notify
    channels = _channels(cfg, run, f"snowcat {run.run_id} (test)")
    if not channels:
        raise UserError(f"{run.path}: the run's config names no channel (notify.command, notify.mail_to)")
    if on_compute_node(run_cfg):
        raise UserError("inside a Slurm job on a compute node without network: run it on the login node")
    line = _one_line(f"snowcat {run.run_id}: test notification (snowcat notify --test) — snowcat status {run.path}")
    failed = 0
    for name, argv in channels.items():
        code, said = _send(argv, line, {"SNOWCAT_NOTIFY_LINE": line, "SNOWCAT_NOTIFY_EVENT": "test"}, run.path)
        print(f"{name}: {'sent' if code == 0 else f'failed (exit {code})'}{': ' + said if said else ''}")
        failed += code != 0
    return 1 if failed else 0


def add_notify_arguments(p) -> None:
    p.add_argument("run")
    p.add_argument("--dry-run", action="store_true", help="write the new events' summary files, send nothing")
    p.add_argument("--test", action="store_true", help="send one test line through the configured channels")


def cmd_notify(args) -> int:
    run = RunDir.open(args.run)
    if args.test:
        return send_test(run)
    lines = notify(run, deliver=not args.dry_run, explicit=True, log=print)
    if not lines:
        print(f"nothing new: {len(list((run.path / NOTIFY_DIR / EVENTS).glob('*.txt')))} event(s) recorded, all handled")
    failed = [line for line in lines if " not sent " in line]
    return 1 if failed else 0
