"""The plan as text (per stage and role, each figure with the assumptions it rests on), as one
summary line (what `snowcat run` prints), and as JSON."""

from __future__ import annotations

import json


def _hours(h: float) -> str:
    if h < 1 / 60:
        return f"{h * 3600:.1f} s"
    return f"{h * 60:.1f} min" if h < 1 else f"{h:,.2f} h"


def _assumptions(plan: dict) -> str:
    a = plan["assumptions"]
    return (
        f"MFU {a['mfu']:.0%}, links and memory at {a['bandwidth_efficiency']:.0%} of peak, memory margin {a['memory_margin']:.0%}, "
        f"filesystem {a['filesystem_gbps']:g} GB/s, communication {a['communication']}, a job's start {a['job_start_s']:g} s, "
        f"the engine {a['decode_step_s'] * 1e3:.3g} ms a decode step and {a['decode_token_s'] * 1e3:.3g} ms a sampled token"
    )


def _parts(parts: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in parts.items() if v >= 0.005)


def role_lines(role: dict) -> list[str]:
    m = role["memory"]
    verdict = "fits" if m["fits"] else "DOES NOT FIT"
    head = f"  {role['role']}: {role.get('layout') or role.get('engine')}, {role['ranks']} rank(s): "
    lines = [
        head
        + f"{m['peak_gib']:.2f} GiB per device of {m['usable_gib']:.2f} usable ({m['device_gib']:.1f} less {m['margin']:.0%}): {verdict}",
        f"    memory (GiB): {_parts(m['parts_gib'])}" + (f"; peak in the {m['peak_phase']}" if m.get("peak_phase") else ""),
    ]
    if "vllm_budget_gib" in m:
        lines.append(f"    vLLM's share {m['vllm_budget_gib']:.2f} GiB; room for {m['kv_tokens_room']:,} KV tokens")
    if "step" in role:
        s = role["step"]
        comm = ", ".join(f"{k.replace('_', ' ')} {v:.3g} s" for k, v in s["comm_s"].items())
        bubble = f", pipeline bubble {s['pipeline_bubble']:.0%}" if s["pipeline_bubble"] else ""
        lines.append(
            f"    step {s['step_s']:.3g} s: compute {s['compute_s']:.3g} s of {s['flops'] / 1e12:,.1f} TFLOP"
            + (f", {comm}" if comm else "")
            + bubble
            + f"  [{s['assumes']}]"
        )
    if "decode" in role:
        d = role["decode"]
        lines.append(
            f"    sampling {d['rollout_s']:.3g} s for {d['sequences']:,} sequences on {d['engines']} engine(s), {d['batch']} at a time, "
            f"{d['waves']} wave(s), {d['decode_step_s'] * 1e3:.3g} ms a token step ({d['bound']}-bound)  [{d['assumes']}]"
        )
    return lines


def _params(n: float) -> str:
    """A parameter count as people write it: 67B, 2.1B, 188k."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def stage_lines(rec: dict, unit: str) -> list[str]:
    model = rec.get("model")
    what = (
        f", model {model['source']} {_params(model['params_total'])} parameters ({_params(model['params_active'])} active)"
        if model
        else ""
    )
    units = f" x {rec['units']} units" if rec["units"] > 1 else ""
    lines = [f"stage {rec['name']} ({rec['kind']}, {rec['nodes']} node(s) on {rec['partition']}{units}{what})"]
    for role in rec["roles"]:
        lines += role_lines(role)
    if "update" in rec:
        u = rec["update"]
        how = "overlapped (lag >= 1)" if u["overlapped"] else "one after the other (lag 0)"
        lines.append(
            f"  update {u['update_s']:.3g} s: train {u['train_s']:.3g} s and rollout {u['rollout_s']:.3g} s {how}, "
            f"weight handoff {u['handoff']['write_s'] + u['handoff']['read_s']:.3g} s ({u['handoff']['bytes'] / 2**30:.2f} GiB written, "
            f"read by each engine) [{u['handoff']['assumes']}], transport {u['transport']['transport_s']:.3g} s"
        )
    if "update" in rec and rec["update"].get("env_s") is not None and rec.get("agent"):
        u = rec["update"]
        lines.append(
            f"  rollout per batch: tools and verification {u['env_s']:.3g} s, a weight version's load {u['engine_reload_s']:.3g} s"
        )
    for env in rec.get("agent", []):
        p = env["profile"]
        lines.append(
            f"  episodes of {env['for']}: {env['episodes']} in waves of {env['wave']}, per episode {p['sandboxed_per_episode']:.3g} "
            f"sandboxed call(s), {p['verified_per_episode']:.3g} verification(s), {p['in_process_per_episode']:.3g} in-process; "
            f"tools {env['env_s']:.3g} s [{env['assumes']}]"
        )
    if "expert" in rec:
        e = rec["expert"]
        lines.append(
            f"  scripted expert: {e['tasks']} tasks in {e['rounds']} round(s) of {e['episode_s']:.3g} s, {e['env_s']:.3g} s [{e['assumes']}]"
        )
    if "engine" in rec:
        e = rec["engine"]
        lines.append(f"  engine builds: {e['builds']} [{e['assumes']}]")
    if rec.get("start", {}).get("each_s"):
        lines.append(f"  start and end outside the updates: {rec['start']['each_s']:.3g} s [{rec['start']['assumes']}]")
    if "job_start" in rec:
        js, work = rec["job_start"], rec.get("work")
        beside = f" + work {sum(v for k, v in work.items() if k.endswith('_s')):.3g} s [{work['assumes']}]" if work else ""
        lines.append(f"  job start {js['each_s']:.3g} s x {js['jobs']} job(s) [{js['assumes']}]{beside}")
    j = rec["jobs"]
    basis = "modelled" if rec["hours_basis"] == "model" else "its walltime, not modelled"
    steps = f"{rec['steps']:,} steps of {rec['step_s']:.3g} s, " if rec.get("steps") else ""
    lines.append(
        f"  {steps}{_hours(rec['hours'])} ({basis}); {j['jobs']} job(s) of {j['walltime_min']} min "
        f"({j['continuations']} continuation(s), {j['allowed'] - 1} allowed); "
        f"{rec['node_hours']:,.2f} node-hours = {rec['charge']:,.2f} {unit}"
    )
    lines += [f"  note: {n}" for n in rec["notes"]]
    return lines


def text(plan: dict) -> str:
    unit = plan["charge_unit"]
    lines = [f"plan: {plan['config']} on site {plan['site']} (charged in {unit})", f"assumptions: {_assumptions(plan)}", ""]
    for rec in plan["stages"]:
        lines += stage_lines(rec, unit)
    t = plan["total"]
    lines += [
        "",
        f"total: {_hours(t['hours'])} of stage time, {t['node_hours']:,.2f} node-hours = {t['charge']:,.2f} {unit} "
        f"(modelled: {', '.join(t['modelled_stages']) or 'none'}; the other stages at their walltime; episode lengths: {t['lengths']})",
        "site checks:",
    ]
    lines += [f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}" for c in plan["checks"]]
    lines.append("")
    if plan["fits"]:
        lines.append("verdict: the plan fits")
    else:
        lines.append("verdict: the plan cannot run as configured:")
        lines += [f"  - {p}" for p in plan["problems"]]
    return "\n".join(lines)


def summary(plan: dict) -> str:
    """One line: node-hours and charge, the tightest memory, the verdict, the assumptions."""
    t = plan["total"]
    tight = None
    for rec in plan["stages"]:
        for role in rec["roles"]:
            m = role["memory"]
            ratio = m["peak_gib"] / m["usable_gib"] if m["usable_gib"] else 0
            if tight is None or ratio > tight[0]:
                tight = (ratio, f"{m['peak_gib']:.1f}/{m['usable_gib']:.1f} GiB ({rec['name']} {role['role']})")
    verdict = "fits" if plan["fits"] else f"cannot fit: {plan['problems'][0]}"
    mem = f"; tightest memory {tight[1]}" if tight else ""
    a = plan["assumptions"]
    return (
        f"plan: {t['node_hours']:,.2f} node-hours = {t['charge']:,.1f} {plan['charge_unit']}{mem}; {verdict} "
        f"[MFU {a['mfu']:.0%}, bandwidth {a['bandwidth_efficiency']:.0%}; `snowcat plan` for the breakdown]"
    )


def to_json(plan: dict) -> str:
    return json.dumps(plan, indent=2, default=str)
