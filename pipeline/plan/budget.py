"""The allocation's remaining budget as the site's own tool prints it, for `snowcat plan`'s allocation
check (sitecheck.budget_check). The profile's `planner.budget` names the tool:

- `taccinfo` (TACC): /usr/local/etc/taccinfo, the table of "Project balances" printed at login, is
  run and its "Avail SUs" of the account the run charges read, in SUs (nodes x hours x the queue's
  charge rate: the profile's `charge_per_node_hour`, charge_unit SU);
- `jutil` (JSC): `jutil user cpuquota` shows a project's quota, but no sample of its output is
  published (JSC's accounting page documents its flags, not its columns), so nothing is parsed: a
  named stub.

A tool that is missing, fails, says nothing within TIMEOUT_S, prints no table, or does not list the
account gives a reading without an amount and the reason; never an exception.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from snowcat.slurm import commands
from snowcat.slurm import site as site_mod

TACCINFO = "/usr/local/etc/taccinfo"  # the path TACC's user guides give (tests point it at a test double)
TIMEOUT_S = 10.0  # taccinfo answers at every login; longer means it is stuck, and the plan goes on

# Tools whose output is not read, and why (the plan's stub line names it).
JUTIL_ACCOUNTING = "https://apps.fz-juelich.de/jsc/hps/jureca/accounting.html"
UNREAD = {
    "jutil": (
        "`jutil user cpuquota` shows it on a JSC login node, but JSC publishes no sample of its output "
        f"(only its flags: {JUTIL_ACCOUNTING}), so it is not read (a stub)"
    ),
}

# taccinfo's balance table, as TACC's Lonestar6 guide shows its output ("Monitor Allocation Usage",
# https://github.com/TACC/TACC-Docs/blob/main/docs/hpc/6lonestar/allocations.md):
#   ---- Project balances for user <user> ----
#   | Name           Avail SUs     Expires | Name           Avail SUs     Expires |
#   | <project>          <SUs>  YYYY-MM-DD | <project>          <SUs>  YYYY-MM-DD |
#   ---- Disk quotas for user <user> ----     (then the disk table, not read)
# Two projects a row, the right cell blank when the count is odd (Frontera's login banner,
# https://github.com/lconcia/life_sciences_ml_at_tacc/blob/main/docs/section1/03_connecting.rst); a
# balance can be negative, "-0" included, and names stop at 13 characters ("FTA-SUB-Dawso") (a
# user's Frontera and Stampede2 output,
# https://github.com/StormSurgeLive/asgs/blob/master/doc/monitoring/automated_monitoring.txt), so an
# account longer than that is matched by the 13 characters shown, when only one name fits.
BALANCES = re.compile(r"Project balances for user (\S+)")
HEADER_CELL = "Name Avail SUs Expires"
ROW_CELL = re.compile(r"^(?P<name>\S+)\s+(?P<sus>-?\d+)\s+(?P<expires>\d{4}-\d{2}-\d{2})$")
NAME_WIDTH = 13  # the widest name in the samples; longer ones were cut to it


@dataclass(frozen=True)
class Allocation:
    name: str
    avail_sus: int
    expires: str


@dataclass(frozen=True)
class Reading:
    """What the tool said: `amount` left in `unit` for `account`, or None and `why` not."""

    source: str  # the command run
    unit: str
    amount: float | None = None
    account: str | None = None
    note: str = ""  # how the account was found, its expiry
    why: str | None = None


class Unreadable(ValueError):
    """The tool's output is not the table its published samples show."""


def parse_taccinfo(text: str) -> list[Allocation]:
    """The projects of taccinfo's "Project balances" table (its disk quota table is not read)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if BALANCES.search(line)), None)
    if start is None:
        raise Unreadable("it printed no 'Project balances for user' table")
    header = lines[start + 1] if start + 1 < len(lines) else ""
    cells = [" ".join(c.split()) for c in header.strip().strip("|").split("|")]
    if not header.lstrip().startswith("|") or HEADER_CELL not in cells:
        raise Unreadable(f"its balance table's header is {header.strip()!r}, not '| {HEADER_CELL} |'")
    out = []
    for line in lines[start + 2 :]:
        row = line.strip()
        if not row.startswith("|"):  # the rule of the disk quota table (or the end) closes it
            break
        for cell in row.strip("|").split("|"):
            cell = cell.strip()
            if not cell:
                continue
            m = ROW_CELL.match(cell)
            if m is None:
                raise Unreadable(f"a project's cell reads {cell!r}, not 'name SUs YYYY-MM-DD'")
            out.append(Allocation(m["name"], int(m["sus"]), m["expires"]))
    return out


def pick(allocations: list[Allocation], account: str | None) -> tuple[Allocation | None, str]:
    """The project the run charges, and how it was found (or why none)."""
    names = ", ".join(a.name for a in allocations) or "none"
    if account is None:
        if len(allocations) == 1:
            return allocations[0], "the only project listed; no account set"
        return None, (
            f"it lists {len(allocations)} projects ({names}) and no account says which the run charges: "
            f"set the site's account (or ${site_mod.ACCOUNT_ENV})"
        )
    exact = [a for a in allocations if a.name == account]
    if exact:
        return exact[0], ""
    cut = [a for a in allocations if len(a.name) >= NAME_WIDTH and account.startswith(a.name)]
    if len(cut) == 1:
        return cut[0], f"listed as {cut[0].name}, its first {len(cut[0].name)} characters"
    return None, f"account {account} is not among its projects ({names})"


def run_tool(cmd: list[str], timeout: float) -> tuple[str | None, str | None]:
    """(stdout, None), or (None, why not)."""
    shown = " ".join(cmd)
    reply = commands.run(cmd, timeout=timeout)
    if reply.code == commands.NO_ANSWER:
        return None, f"`{shown}` gave no answer in {timeout:g} s"
    if reply.code in (commands.NOT_FOUND, commands.CANNOT_RUN) and not reply.out:
        return None, f"`{shown}` could not start: {reply.err}"
    if not reply.ok:
        last = (reply.err.strip() or reply.out.strip()).splitlines()[-1:] or ["no output"]
        return None, f"`{shown}` exited {reply.code}: {last[0]}"
    return reply.out, None


def read_taccinfo(site) -> Reading:
    account = site.account or site_mod.env_account()
    reading = Reading(source=TACCINFO, unit="SU", account=account)
    if site.planner.charge_unit != "SU":
        return _why(reading, f"taccinfo counts SUs, but site {site.name} charges in {site.planner.charge_unit}")
    if not os.access(TACCINFO, os.X_OK):
        return _why(reading, f"{TACCINFO} is not on this machine (TACC's login nodes have it)")
    out, why = run_tool([TACCINFO], TIMEOUT_S)
    if why:
        return _why(reading, why)
    try:
        allocations = parse_taccinfo(out)
    except Unreadable as e:
        return _why(reading, f"{TACCINFO}: {e}")
    found, how = pick(allocations, account)
    if found is None:
        return _why(reading, f"{TACCINFO}: {how}")
    note = "; ".join(part for part in (how, f"expires {found.expires}") if part)
    return Reading(source=TACCINFO, unit="SU", amount=float(found.avail_sus), account=found.name, note=note)


def _why(reading: Reading, why: str) -> Reading:
    return Reading(source=reading.source, unit=reading.unit, account=reading.account, why=why)


READERS = {"taccinfo": read_taccinfo}


def remaining(site) -> Reading | None:
    """The remaining budget the site's tool reports; None where the profile names no tool that is read
    (`budget: none`, or one in UNREAD)."""
    reader = READERS.get(site.planner.budget)
    return reader(site) if reader else None
