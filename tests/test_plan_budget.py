"""`snowcat plan`'s allocation check against the remaining budget the site's tool reports
(pipeline/plan/budget.py, sitecheck.budget_check): TACC's taccinfo is run as a real executable (a
TEST DOUBLE printing a fixture; TACC's own taccinfo cannot run here) and its balance table read; JSC's
jutil stays a named stub (no published sample of its output). Each fixture follows a published
sample field by field (layout, column widths, blank cells, trailing spaces, signs, cut names), with
its own names and figures; the sample's address is beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from snowcat.pipeline import cli
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.plan import budget, core
from tests.test_plan import CONFIG, SITE

# TACC's Lonestar6 guide, "Monitor Allocation Usage": the output of `login1$ /usr/local/etc/taccinfo`
# https://github.com/TACC/TACC-Docs/blob/main/docs/hpc/6lonestar/allocations.md
# (commit 14cea1d82f4d9277c9920e92441900ff73e4a697): two projects on one row, then the disk table.
TACC_DOCS_LS6 = """\
--------------------- Project balances for user user01 ------------------------
| Name           Avail SUs     Expires | Name           Avail SUs     Expires |
| A-proj1           250000  2030-09-30 | A-proj2             3100  2026-09-30 |
------------------------ Disk quotas for user user01 --------------------------
| Disk         Usage (GB)     Limit    %Used   File Usage       Limit   %Used |
| /scratch            4.2       0.0     0.00        12345           0    0.00 |
| /home1              1.5      10.0    15.00        11111           0    0.00 |
| /work               0.9    1024.0     0.09        20000     3000000    0.67 |
-------------------------------------------------------------------------------
"""

# Lonestar6's login banner, its taccinfo part (five projects: the last row's right cell blank; a
# trailing space, \x20, after the full rows' last bar; a 13-character name)
# https://github.com/wjallen/IntroToLinuxHPC/blob/master/docs/setup/setup.rst
# (commit 45e39d2d949a6e59b54ef917ea22c6c79920c374)
LS6_BANNER = """\
---------------------- Project balances for user user02 -----------------------
| Name           Avail SUs     Expires | Name           Avail SUs     Expires |
| PRJ22001             700  2024-09-30 | ProteinDesign       5200  2024-03-31 |\x20
| TACC-TRAIN         41000  2025-06-30 | OTH22099           12000  2024-06-30 |\x20
| IBN22011            1800  2024-09-30 |                                      |
------------------------- Disk quotas for user user02 -------------------------
| Disk         Usage (GB)     Limit    %Used   File Usage       Limit   %Used |
| /scratch          120.4       0.0     0.00        50000           0    0.00 |
| /home1              2.1      11.7    17.95        15000           0    0.00 |
| /work             300.0    1024.0    29.30      1500000     3000000   50.00 |
-------------------------------------------------------------------------------
"""

# Frontera's login banner, its taccinfo part: one project, the right cell blank
# https://github.com/lconcia/life_sciences_ml_at_tacc/blob/main/docs/section1/03_connecting.rst
# (commit 460a28fa3262ac0aa7db39e51bc1b8b8fad1e2f3)
FRONTERA_ONE = """\
---------------------- Project balances for user user03 ----------------------
| Name           Avail SUs     Expires |                                      |
| TACC-TRAIN         90000  2025-06-30 |                                      |
------------------------ Disk quotas for user user03 -------------------------
| Disk         Usage (GB)     Limit    %Used   File Usage       Limit   %Used |
| /home1              2.0      25.0     8.00         4000      200000    2.00 |
| /work2            500.0    1024.0    48.83       300000     3000000   10.00 |
-------------------------------------------------------------------------------
"""

# taccinfo on Frontera and Stampede2 as a TACC user pasted it: negative balances ("-3571", "-0") and
# names cut to 13 characters ("FTA-SUB-Dawso"); the trailing \x20 as there
# https://github.com/StormSurgeLive/asgs/blob/master/doc/monitoring/automated_monitoring.txt
# (commit 920dc53dd6c0f0fcff985d1c63742a4d3d404bce)
FRONTERA_OVERDRAWN = """\
--------------------- Project balances for user user04 ----------------------
| Name           Avail SUs     Expires | Name           Avail SUs     Expires |
| FTA-SUB-Longn      -2500  2020-06-30 | ASC20099           80000  2021-03-31 |\x20
| DesignSafe-XY         -0  2023-12-31 |                                      |
------------------------ Disk quotas for user user04 ------------------------
| Disk         Usage (GB)     Limit    %Used   File Usage       Limit   %Used |
| /home1              1.0      25.0     4.00        40000      400000   10.00 |
-------------------------------------------------------------------------------
"""


@pytest.fixture
def files(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(SITE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    return cfg, site


@pytest.fixture
def taccinfo(tmp_path, monkeypatch):
    """Installs a TEST DOUBLE of TACC's taccinfo (which cannot run here) at budget.TACCINFO: a shell
    script that prints `output` and exits `code` (or never answers, with `hang`)."""
    monkeypatch.delenv("SBATCH_ACCOUNT", raising=False)

    def install(output: str = "", code: int = 0, hang: bool = False) -> Path:
        fixture = tmp_path / "taccinfo-output.txt"
        fixture.write_text(output)
        double = tmp_path / "fake_taccinfo"
        body = (
            "sleep 60  # a child holding the output open, as a wrapper script's would"
            if hang
            else f"cat '{fixture}'\nexit {code}"
        )
        double.write_text(f"#!/bin/sh\n# TEST DOUBLE: TACC's /usr/local/etc/taccinfo cannot run here\n{body}\n")
        double.chmod(0o755)
        monkeypatch.setattr(budget, "TACCINFO", str(double))
        return double

    return install


TACC_SITE = ["site.planner.budget=taccinfo", "site.planner.charge_unit=SU"]


def plan(cfg, site, *overrides, budget_n=None):
    run = config_mod.typed(config_mod.load(cfg, [*TACC_SITE, *overrides], site=str(site)))
    return core.make_plan(run, budget=budget_n)


def allocation(p: dict) -> dict:
    return next(c for c in p["checks"] if c["check"] == "allocation")


# ------------------------------------------------------------------------------ taccinfo's table


def test_the_ls6_guide_table_reads_as_its_two_projects():
    got = budget.parse_taccinfo(TACC_DOCS_LS6)
    assert got == [
        budget.Allocation("A-proj1", 250000, "2030-09-30"),
        budget.Allocation("A-proj2", 3100, "2026-09-30"),
    ]


def test_blank_cells_trailing_spaces_and_one_project_rows_read():
    names = [a.name for a in budget.parse_taccinfo(LS6_BANNER)]
    assert names == ["PRJ22001", "ProteinDesign", "TACC-TRAIN", "OTH22099", "IBN22011"]
    assert budget.parse_taccinfo(FRONTERA_ONE) == [budget.Allocation("TACC-TRAIN", 90000, "2025-06-30")]


def test_negative_balances_and_cut_names():
    got = {a.name: a.avail_sus for a in budget.parse_taccinfo(FRONTERA_OVERDRAWN)}
    assert got == {"FTA-SUB-Longn": -2500, "ASC20099": 80000, "DesignSafe-XY": 0}
    allocs = budget.parse_taccinfo(FRONTERA_OVERDRAWN)
    found, how = budget.pick(allocs, "FTA-SUB-Longname")  # shown cut to its first 13 characters
    assert found.name == "FTA-SUB-Longn" and "first 13 characters" in how
    assert budget.pick(allocs, "ASC2009")[0] is None  # a prefix of a short name is another project


def test_a_balance_shaped_row_outside_the_balance_table_is_not_read():
    """An attempt to fool the reader: a row that looks like a project's balance, for an account the
    table does not list, after the disk table's rule and in a second table further down."""
    forged = TACC_DOCS_LS6 + "| A-proj9         999999  2030-01-01 |\n"
    forged += "--- Project balances for user user01 ---\n| A-proj9         999999  2030-01-01 |\n"
    assert [a.name for a in budget.parse_taccinfo(forged)] == ["A-proj1", "A-proj2"]
    assert budget.pick(budget.parse_taccinfo(forged), "A-proj9")[0] is None


def test_output_without_the_table_is_refused_naming_what_is_wrong():
    with pytest.raises(budget.Unreadable, match="no 'Project balances for user' table"):
        budget.parse_taccinfo("Welcome to Lonestar6\n")
    broken = TACC_DOCS_LS6.replace("250000", "lots")
    with pytest.raises(budget.Unreadable, match="A-proj1 +lots"):
        budget.parse_taccinfo(broken)


# ------------------------------------------------------------------------------ the plan's check


def test_the_plan_is_checked_against_what_taccinfo_says_is_left(files, taccinfo):
    cfg, site = files
    taccinfo(TACC_DOCS_LS6)
    p = plan(cfg, site, "site.account=A-proj2")
    check = allocation(p)
    assert check["ok"] and p["fits"]
    assert check["remaining"] == {"amount": 3100.0, "unit": "SU", "account": "A-proj2", "source": budget.TACCINFO}
    assert "3,100 SU left on A-proj2" in check["detail"] and "expires 2026-09-30" in check["detail"]


def test_a_plan_charging_more_than_is_left_is_refused(files, taccinfo):
    cfg, site = files
    taccinfo(FRONTERA_OVERDRAWN)
    p = plan(cfg, site, "site.account=FTA-SUB-Longname")
    check = allocation(p)
    assert not check["ok"] and not p["fits"]
    assert "more than the -2,500 SU left on FTA-SUB-Longn" in check["detail"]
    assert any(problem.startswith("site ") and "allocation" in problem for problem in p["problems"])


def test_an_explicit_budget_wins_over_the_tool(files, taccinfo):
    cfg, site = files
    taccinfo(FRONTERA_OVERDRAWN)  # would refuse: -2,500 SU left
    check = allocation(plan(cfg, site, "site.account=FTA-SUB-Longname", budget_n=100.0))
    assert check["ok"] and "of --budget 100.0 SU" in check["detail"] and "remaining" not in check


def test_the_account_comes_from_sbatch_account_or_the_only_project(files, taccinfo, monkeypatch):
    cfg, site = files
    taccinfo(LS6_BANNER)
    monkeypatch.setenv("SBATCH_ACCOUNT", "OTH22099")
    assert allocation(plan(cfg, site, "site.account=null"))["remaining"]["account"] == "OTH22099"
    monkeypatch.delenv("SBATCH_ACCOUNT")
    several = allocation(plan(cfg, site, "site.account=null"))
    assert several["ok"] and "lists 5 projects" in several["detail"] and "$SBATCH_ACCOUNT" in several["detail"]
    taccinfo(FRONTERA_ONE)
    one = allocation(plan(cfg, site, "site.account=null"))
    assert one["remaining"]["account"] == "TACC-TRAIN" and "the only project listed" in one["detail"]


@pytest.mark.parametrize(
    ("output", "code", "hang", "says"),
    [
        (None, 0, False, "is not on this machine"),
        (
            "taccinfo: cannot reach the accounting database\n",
            3,
            False,
            "exited 3: taccinfo: cannot reach the accounting database",
        ),
        ("<html>Service Unavailable</html>\n", 0, False, "printed no 'Project balances for user' table"),
        (TACC_DOCS_LS6, 0, False, "account snowcat is not among its projects (A-proj1, A-proj2)"),
        ("", 0, True, "gave no answer in 0.3 s"),
    ],
    ids=["missing", "fails", "garbage", "account-not-listed", "times-out"],
)
def test_a_budget_that_cannot_be_read_is_unknown_with_the_reason(files, taccinfo, monkeypatch, output, code, hang, says):
    cfg, site = files
    if output is None:
        monkeypatch.setattr(budget, "TACCINFO", str(Path(cfg).parent / "no-such-taccinfo"))
    else:
        taccinfo(output, code, hang)
    monkeypatch.setattr(budget, "TIMEOUT_S", 0.3)
    p = plan(cfg, site)  # the test site's account: snowcat
    check = allocation(p)
    assert check["ok"] and p["fits"] and "remaining" not in check
    assert check["detail"].startswith("remaining allocation unknown: ") and says in check["detail"]
    assert check["detail"].endswith("pass --budget N")


def test_a_profile_charging_in_another_unit_is_not_compared_with_sus(files, taccinfo):
    cfg, site = files
    taccinfo(TACC_DOCS_LS6)
    check = allocation(plan(cfg, site, "site.account=A-proj1", "site.planner.charge_unit=node-hours"))
    assert check["ok"] and "taccinfo counts SUs, but site" in check["detail"] and "node-hours" in check["detail"]


def test_jutil_stays_a_named_stub(files):
    cfg, site = files
    check = allocation(plan(cfg, site, "site.planner.budget=jutil", "site.planner.charge_unit=core-h"))
    assert check["ok"] and "(a stub)" in check["detail"] and budget.JUTIL_ACCOUNTING in check["detail"]


# ------------------------------------------------------------------------------ the commands


def test_plan_prints_the_remaining_budget_line(files, taccinfo, capsys):
    cfg, site = files
    taccinfo(TACC_DOCS_LS6)
    assert cli.main(["plan", str(cfg), "--site", str(site), *TACC_SITE, "site.account=A-proj1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "allocation:" in x)
    assert line.lstrip().startswith("ok") and "of the 250,000 SU left on A-proj1" in line


def test_run_refuses_a_plan_over_the_remaining_budget_in_one_line(files, taccinfo, capsys):
    cfg, site = files
    taccinfo(FRONTERA_OVERDRAWN)
    code = cli.main(["run", str(cfg), "--site", str(site), "--dry-run", *TACC_SITE, "site.account=DesignSafe-XY"])
    err = capsys.readouterr().err
    refusal = [x for x in err.splitlines() if "the plan cannot fit" in x]
    assert code == 2 and len(refusal) == 1
    assert "allocation: 0.0 SU planned, more than the 0 SU left on DesignSafe-XY" in refusal[0]
    assert "nothing was submitted" in refusal[0] and "--skip-plan" in refusal[0]
