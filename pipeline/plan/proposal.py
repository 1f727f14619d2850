"""The technical-justification section of a compute-time proposal, in Markdown: the resource table,
the scaling argument, a plot of node-hours per stage, and the assumptions the numbers rest on."""

from __future__ import annotations

from pathlib import Path

from snowcat.pipeline.fsio import atomic_write_text


def _bar(value: float, biggest: float, width: int = 30) -> str:
    return "#" * max(1 if value > 0 else 0, round(width * value / biggest)) if biggest else ""


def plot(plan: dict, path: Path) -> bool:
    """Node-hours per stage as a PNG (matplotlib, headless); False where matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415 (optional, only for the proposal)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    names = [r["name"] for r in plan["stages"]]
    values = [r["node_hours"] for r in plan["stages"]]
    colors = ["tab:blue" if r["hours_basis"] == "model" else "tab:gray" for r in plan["stages"]]
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(names) + 1.2))
    ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel("node-hours (blue: modelled; gray: walltime requested)")
    ax.set_title(f"{plan['config']} on {plan['site']}: node-hours per stage")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown(plan: dict, image: str | None = None, runs: int = 1) -> str:
    unit = plan["charge_unit"]
    a = plan["assumptions"]
    t = plan["total"]
    lines = [
        f"## Technical justification: {plan['config']} on {plan['site']}",
        "",
        "### Resources requested",
        "",
        f"| stage | kind | nodes | devices per node | time per run | node-hours | {unit} | basis |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in plan["stages"]:
        devices = sum(role["ranks"] for role in r["roles"]) if r["roles"] else "-"
        lines.append(
            f"| {r['name']} | {r['kind']} | {r['nodes']}{' x ' + str(r['units']) + ' units' if r['units'] > 1 else ''} | "
            f"{devices} | {r['hours']:.2f} h | {r['node_hours']:,.1f} | {r['charge']:,.1f} | "
            f"{'model' if r['hours_basis'] == 'model' else 'walltime'} |"
        )
    lines += [
        f"| **total (one run)** | | | | {t['hours']:.2f} h | {t['node_hours']:,.1f} | {t['charge']:,.1f} | |",
    ]
    if runs > 1:
        lines.append(f"| **total ({runs} runs)** | | | | | {t['node_hours'] * runs:,.1f} | {t['charge'] * runs:,.1f} | |")
    lines += ["", "### Node-hours per stage", ""]
    if image:
        lines += [f"![node-hours per stage]({image})", ""]
    biggest = max((r["node_hours"] for r in plan["stages"]), default=0)
    lines += (
        ["```"]
        + [f"{r['name']:<16} {_bar(r['node_hours'], biggest)} {r['node_hours']:,.1f}" for r in plan["stages"]]
        + ["```", ""]
    )
    lines += ["### Memory per device and why this layout", ""]
    for r in plan["stages"]:
        for role in r["roles"]:
            m = role["memory"]
            what = role.get("layout") or f"{role.get('engine')} engine"
            lines.append(
                f"- `{r['name']}` {role['role']} ({what}, {role['ranks']} ranks): {m['peak_gib']:.1f} GiB of "
                f"{m['usable_gib']:.1f} GiB usable per device (device {m['device_gib']:.0f} GiB, {m['margin']:.0%} kept free)."
            )
    lines += ["", "### Scaling argument", ""]
    for r in plan["stages"]:
        for role in r["roles"]:
            if "step" not in role:
                continue
            s = role["step"]
            comm = sum(s["comm_s"].values())
            share = comm / s["step_s"] if s["step_s"] else 0
            lines.append(
                f"- `{r['name']}`: one step computes {s['flops'] / 1e15:,.2f} PFLOP in {s['compute_s']:.2f} s at the assumed MFU; "
                f"communication adds {comm:.2f} s ({share:.0%} of the step)"
                + (f", the pipeline bubble {s['pipeline_bubble']:.0%}" if s["pipeline_bubble"] else "")
                + ". "
                + (
                    "Compute dominates, so more nodes shorten the stage nearly in proportion at the same node-hours."
                    if share < 0.25
                    else "Communication is a large share: more nodes would raise node-hours; the layout is kept as small as memory allows."
                )
            )
        if "update" in r:
            u = r["update"]
            lines.append(
                f"- `{r['name']}`: an update trains for {u['train_s']:.1f} s and samples for {u['rollout_s']:.1f} s"
                f" ({'overlapped' if u['overlapped'] else 'in sequence'}); the rollout:trainer split balances the two."
            )
    lines += [
        "",
        "### Assumptions",
        "",
        f"- Achieved model FLOPs utilisation {a['mfu']:.0%} of the devices' peak dense bf16 rate; links and device memory at "
        f"{a['bandwidth_efficiency']:.0%} of their peak bandwidth; communication not overlapped with compute (conservative).",
        f"- {a['memory_margin']:.0%} of device memory kept free; the shared filesystem at {a['filesystem_gbps']:g} GB/s for checkpoints and weight handoff.",
        f"- Episode lengths: {plan['total']['lengths']}; each job adds {a['job_start_s']:g} s of start-up; short stages "
        "(tasks, select, export, card, ...) are that plus their own work; stages the planner does not model are counted at "
        "their requested walltime.",
        "- Computed by `snowcat plan` (docs/planning.md) from the run configuration and the site profile; validated against measured "
        "memory in `benchmarks/results/plan-validation.json`.",
    ]
    if a["sources"]:
        lines += ["- Site facts from: " + "; ".join(a["sources"])]
    if a["unverified"]:
        lines += ["- Not confirmed by a document (to check on the system): " + ", ".join(a["unverified"])]
    return "\n".join(lines) + "\n"


def write(plan: dict, path: str | Path, runs: int = 1) -> list[Path]:
    """The proposal section (Markdown) and its plot (PNG beside it, where matplotlib is installed)."""
    path = Path(path)
    image = path.with_suffix(".png")
    made = plot(plan, image)
    atomic_write_text(path, markdown(plan, image.name if made else None, runs))
    return [path] + ([image] if made else [])
