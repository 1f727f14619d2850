"""The planner's numbers beside measured ones: `snowcat bench plan-validation`.

    snowcat bench plan-validation --measured [LABEL=]FILE.json [...] [--activations FILE.json ...]
                                  [--calibrate RUN|POINTS.json] [--run-compare LABEL=RUN ...] [--json OUT]

1. Memory on the CPU: for every mode of a `snowcat bench trainer-memory --json` result (2 gloo
   ranks, AdamW, fp32; `--steps 2` measures a step with the moments held, as the planner's is),
   the planner's peak per rank (`pipeline.plan.memory`, less what the rank's imports hold, which
   the benchmark does not count) beside the measured one: the largest rank's VmHWM during the
   measured step above its start, with glibc's mmap threshold fixed (RSS then follows the live
   tensors; the default allocator keeps freed blocks). Within 15% is the target for every mode
   (MODELLED: the torch backend's layouts, FSDP, DeepSpeed's ZeRO-2/3 and megatron's).
2. Activations, tensor by tensor: `snowcat bench activation-count` results (what autograd saved,
   and the backward's high-water mark) beside the planner's `activations` (+ `logits`).
3. Time on this machine: `--calibrate RUN` fits the local site's constants on one finished demo
   run (CALIBRATION below: the job start cost, the short stages' own work, the engine's cost per
   decode step and per sampled token); `--run-compare` puts what `snowcat plan --compare RUN`
   recorded (every stage's step time, peak memory and node-hours, predicted and measured, and the
   run's total) beside it, for the calibration run and for a validation run of other sizes: within
   15% is the target for every modelled stage with a measured time and for the total; a stage that
   misses is listed as missing, not tuned.
4. Published peers: the planner's memory and step time for a published layout beside the published
   figures, each with its source (PEERS below; nothing here is measured by us).

No torch: the planner runs from the recorded measurement and the published configurations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.plan.memory import GIB, Layout, cpu_imports_bytes, make_layout, trainer_memory
from snowcat.pipeline.plan.model import Arch
from snowcat.pipeline.plan.timing import Hardware, train_step
from snowcat.stages.model.config import PRESETS, ModelConfig

TARGET = 0.15
MODELLED = (
    "ddp",
    "ddp+ep2",
    "fsdp",
    "fsdp+ep2",
    "zero2",
    "zero3",
    "megatron",
    "megatron+ep2",
    "megatron+tp2",
    "megatron+pp2",
)
ALLOCATOR = "fixed mmap threshold 128 KiB"
MIB = 2**20

# Qwen3-30B-A3B: the architecture as published configs give it.
QWEN3_30B_A3B = {
    "config": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "source": "Qwen3-30B-A3B config.json fields as reproduced in https://gitcode.com/Ascend/MindSpeed-RL/blob/master/configs/model/qwen3_30b_a3b.yaml "
    "(48 layers, hidden 2048, 32 heads, 4 query groups, kv_channels 128, 128 experts top-8, moe_ffn_hidden_size 768, vocab 151936, untied)",
}

PEERS = [
    {
        "name": "prime-rl Qwen3-30B-A3B-Instruct-2507, RL full fine-tune, 8x H100 80GB, seq 16384",
        "source": "https://github.com/PrimeIntellect-ai/prime-rl/blob/767aaadfcfccdda9ee2be745571081d637b99b81/benchmarks/baselines/"
        "benchmark-8xh100-Qwen--Qwen3-30B-A3B-Instruct-2507-rl-full-8gpu-Recompute-flash_attention_3-16384-cp1-ep1.json",
        "published": {
            "peak_memory_gib": 74.587890625,
            "peak_memory_pct": 94.20180595190192,
            "step_time_s": 8.173900715999784,
            "step_time_note": "prime-rl's BENCHMARKS.md: the step time shown is per micro batch",
            "throughput_tokens_per_s": 6113.178662139965,
            "mfu_pct": 2.9033962435015255,
            "micro_batches": 2,
            "activation_checkpointing": "Recompute",
            "attention": "flash_attention_3",
        },
        "layout": {"backend": "fsdp", "ranks": 8, "ep": 1, "rows_per_micro": 1, "seq_len": 16384, "micro_batches": 2},
        "assumed": "FSDP2 over 8 ranks (prime-rl's trainer), one 16384-token row per rank per micro batch, float32 masters and "
        "bf16 compute (the planner's defaults; prime-rl's own precision settings not checked), activation checkpointing on",
    },
]


FIRST_STEP_CAVEAT = (
    "the benchmark measured the first step, when AdamW's moments do not exist yet during forward/backward; "
    "the planner's peak is a later step's (moments held throughout)"
)


def _arch_of(measured: dict) -> Arch:
    model = {k: v for k, v in measured["model"].items() if k != "params"}
    return Arch("trainer-memory benchmark", ModelConfig.from_dict(model))


def planned_mib(model: dict, step: dict, mode: dict) -> dict:
    """The planner's peak per rank (MiB) and its parts for one mode of a trainer-memory run."""
    arch = Arch("trainer-memory benchmark", ModelConfig.from_dict({k: v for k, v in model.items() if k != "params"}))
    lay = Layout(
        ranks=step["ranks"],
        backend=mode["backend"],
        ep=mode["expert_parallel"],
        tp=mode.get("tensor_parallel", 1),
        pp=mode.get("pipeline_parallel", 1),
        zero_stage=mode["zero_stage"],
    )
    plan = trainer_memory(arch, lay, step["rows_per_rank"] * step["seq"], 1, on_gpu=False, seq_len=step["seq"])
    # the benchmark counts above what the rank held with its libraries imported: so does this
    peak = plan["peak"] - cpu_imports_bytes(lay.backend)
    return {"peak": round(peak / MIB, 1), "parts": {k: round(v / MIB, 1) for k, v in plan["parts"].items()}}


def cpu_memory(measured: dict, label: str) -> dict:
    """Planner against one trainer-memory measurement."""
    arch = _arch_of(measured)
    step = measured["step"]
    measured_step = step.get("measured_step", 1)
    tokens = step["rows_per_rank"] * step["seq"]
    results = measured["results"][ALLOCATOR]
    rows = {}
    for mode, res in results.items():
        planned = planned_mib(measured["model"], step, res)
        meas = res["max_rank_step_mib"]
        pred = planned["peak"]
        rows[mode] = {
            "backend": res["backend"],
            "zero_stage": res["zero_stage"],
            "expert_parallel": res["expert_parallel"],
            "tensor_parallel": res.get("tensor_parallel", 1),
            "pipeline_parallel": res.get("pipeline_parallel", 1),
            "planned_mib": pred,
            "measured_mib": meas,
            "ratio": round(pred / meas, 3),
            "within_15pct": abs(pred / meas - 1) <= TARGET,
            "claimed": mode in MODELLED,
            "planned_parts_mib": planned["parts"],
        }
    return {
        "label": label,
        "command": measured.get("command"),
        "machine": measured.get("machine"),
        "model_params": arch.total,
        "model": measured["model"],
        "step": step,
        "tokens_per_rank": tokens,
        "measured": f"max over ranks of step_mib ({ALLOCATOR}): VmHWM during AdamW step {measured_step} above the rank's start",
        "caveat": FIRST_STEP_CAVEAT if measured_step == 1 else None,
        "all_claimed_within_15pct": all(r["within_15pct"] for r in rows.values() if r["claimed"]),
        "modes": rows,
    }


def activation_row(counted: dict) -> dict:
    """An activation-count measurement beside the planner's activations (and, for the backward's
    high-water mark, activations + the logprob kernel's buffers), recomputed here."""
    arch = Arch("trainer-memory benchmark", ModelConfig.from_dict(counted["model"]))
    parts = trainer_memory(arch, Layout(ranks=1), counted["tokens"], 1, on_gpu=False)["parts"]
    saved, planned = counted["saved_bytes"] / MIB, parts["activations"] / MIB
    backward, planned_backward = counted["backward_hwm_above_model_bytes"] / MIB, (parts["activations"] + parts["logits"]) / MIB
    return {
        "tokens": counted["tokens"],
        "model": counted["model"],
        "command": counted["command"],
        "saved_mib": round(saved, 1),
        "planned_mib": round(planned, 1),
        "ratio": round(planned / saved, 3),
        "backward_peak_mib": round(backward, 1),
        "planned_backward_mib": round(planned_backward, 1),
        "backward_ratio": round(planned_backward / backward, 3),
        "saved_by_site_mib": counted["saved_by_site_mib"],
    }


CALIBRATION = (
    "local site constants fitted on the calibration run's own records: mfu the planner's FLOPs per SFT step over the "
    "rank's peak x the measured step (train_seconds / steps); job_start_s the median over its jobs of "
    "(job start to end) - (the stage's duration_s); stage_work_s each short stage's duration_s; decode_step_s and "
    "decode_token_s by least squares of (each evaluate checkpoint's sample_s - the planner's hardware-bound time "
    "for its waves at that mfu) on (decode steps, sampled tokens), the waves as `snowcat plan --compare` builds them"
)


def calibration_points(run_path: str, site: str = "local") -> dict:
    """What `--calibrate` fits, read from a finished run: each job's start-to-end seconds and its
    stage's own `duration_s`; each evaluate checkpoint's `sample_s` beside the planner's waves for
    it (decode steps, sampled tokens) and their time at the hardware bound alone."""
    import dataclasses  # noqa: PLC0415

    from snowcat.pipeline.plan import core  # noqa: PLC0415
    from snowcat.pipeline.plan import lengths as lengths_mod  # noqa: PLC0415
    from snowcat.pipeline.plan.command import open_run  # noqa: PLC0415
    from snowcat.pipeline.plan.compare import finished, unit_seconds  # noqa: PLC0415
    from snowcat.pipeline.plan.model import stage_arch  # noqa: PLC0415
    from snowcat.pipeline.plan.timing import decode  # noqa: PLC0415

    run, typed, dag, _ = open_run(run_path, site)
    done = finished(run, dag)
    jobs, training, sampling = [], [], []
    for name, stage in typed.stages.items():
        unit = dag[name].units[0]
        metrics = run.metrics(unit)
        jobs.append({"stage": name, "kind": stage.kind, "job_s": unit_seconds(run, unit), "work_s": metrics.get("duration_s")})
        if stage.kind == "sft" and metrics.get("train_seconds"):
            res = stage.resources
            training.append(
                {
                    "stage": name,
                    "flops_per_step": core.plan_stage(typed, name, {})["roles"][0]["step"]["flops"],
                    "rank_peak_flops": core.hardware(typed.site, res.partition, res.tasks_per_node).rank_flops(),
                    "measured_step_s": metrics["train_seconds"] / stage.steps,
                }
            )
    mfu = calibrated_mfu(training)
    for name, stage in typed.stages.items():
        if stage.kind != "evaluate":
            continue
        metrics = run.metrics(dag[name].units[0])
        inputs = lengths_mod.inputs_of(typed, name, done)
        res = stage.resources
        hw = dataclasses.replace(
            core.hardware(typed.site, res.partition, res.tasks_per_node), mfu=mfu, decode_step_s=0.0, decode_token_s=0.0
        )
        arch = stage_arch(typed, name, {})
        for ref in core._sampling_refs(stage):
            waves = lengths_mod.ordered_waves(
                lengths_mod.eval_lengths(typed, stage, ref, inputs, 1), stage.attempts, stage.batch_size
            )
            sampling.append(
                {
                    "stage": name,
                    "checkpoint": ref,
                    "steps": waves.steps,
                    "sampled": waves.sampled,
                    "hardware_s": decode(arch, hw, waves, engines=1, tp=1)["rollout_s"],
                    "measured_s": metrics.get(f"{ref}/sample_s"),
                }
            )
    origin = (json.loads((run.path / "run.json").read_text()) or {}).get("origin")
    return {"run": str(run.path), "run_origin": origin, "site": site, "jobs": jobs, "training": training, "sampling": sampling}


def calibrated_mfu(training: list[dict]) -> float:
    """The fraction of a rank's peak SFT's steps reached: the planner's FLOPs per step over peak x
    measured step (the median over the run's SFT stages)."""
    import numpy as np  # noqa: PLC0415

    return round(float(np.median([t["flops_per_step"] / (t["rank_peak_flops"] * t["measured_step_s"]) for t in training])), 3)


def calibrate(points: dict) -> dict:
    """The local site's constants from `calibration_points` (CALIBRATION says how)."""
    import numpy as np  # noqa: PLC0415

    from snowcat.pipeline.plan.core import SHORT  # noqa: PLC0415

    jobs = [j for j in points["jobs"] if j["job_s"] is not None and j["work_s"] is not None]
    start = float(np.median([j["job_s"] - j["work_s"] for j in jobs]))
    work = {j["kind"]: round(j["work_s"], 2) for j in jobs if j["kind"] in SHORT}
    rows = [r for r in points["sampling"] if r["measured_s"] is not None]
    a = np.array([[r["steps"], r["sampled"]] for r in rows])
    b = np.array([r["measured_s"] - r["hardware_s"] for r in rows])
    (step, token), *_ = np.linalg.lstsq(a, b, rcond=None)
    fit = [
        {
            "stage": r["stage"],
            "checkpoint": r["checkpoint"],
            "measured_s": r["measured_s"],
            "fitted_s": round(float(r["hardware_s"] + step * r["steps"] + token * r["sampled"]), 3),
        }
        for r in rows
    ]
    return {
        "how": CALIBRATION,
        "run": points["run"],
        "run_origin": points["run_origin"],
        "mfu": calibrated_mfu(points["training"]),
        "job_start_s": round(start, 2),
        "stage_work_s": work,
        "decode_step_s": round(float(step), 6),
        "decode_token_s": round(float(token), 7),
        "fit": fit,
        "points": points,
    }


def _within(ratio) -> bool | None:
    return None if ratio is None else abs(ratio - 1) <= TARGET


def run_compare(label: str, path: str, conditions: str | None = None) -> dict:
    """What `snowcat plan --compare RUN` recorded (RUN/plan/compare.json, or a copy of it): every
    stage's step time, peak memory and node-hours, the run's total, and which modelled stages with
    a measured time are within the target (node-hours; step time where both are recorded)."""
    path = Path(path)
    recorded = json.loads((path / "plan" / "compare.json" if path.is_dir() else path).read_text())
    stages = [
        {k: r.get(k) for k in ("stage", "kind", "step_s", "peak_memory_gib", "node_hours", "plan_basis", "lengths")}
        for r in recorded["stages"]
    ]
    misses = []
    for r in stages:
        if r["plan_basis"] != "model":
            continue
        for what in ("node_hours", "step_s"):
            if _within(r[what]["ratio"]) is False:
                misses.append(f"{r['stage']} {what} x{r[what]['ratio']}")
    total = recorded.get("total", {}).get("node_hours")
    return {
        "label": label,
        "recorded": str(path),
        "conditions": conditions,  # what the machine was doing meanwhile (its load), as the caller measured it
        "site": recorded["site"],
        "command": recorded.get("command"),
        "run_origin": recorded.get("run_origin"),
        "assumptions": recorded["assumptions"],
        "stages": stages,
        "total_node_hours": total,
        "total_within_15pct": _within(total["ratio"]) if total else None,
        "misses": misses,
    }


def peer_rows() -> list[dict]:
    out = []
    for peer in PEERS:
        arch = Arch("Qwen3-30B-A3B", QWEN3_30B_A3B["config"])
        lay_cfg = peer["layout"]
        lay = Layout(
            ranks=lay_cfg["ranks"],
            backend=lay_cfg["backend"],
            ep=lay_cfg["ep"],
            master_bytes=4,
            compute_bytes=2,
            activation_checkpointing=True,
        )
        tokens_micro = lay_cfg["rows_per_micro"] * lay_cfg["seq_len"]
        mem = trainer_memory(arch, lay, tokens_micro, lay_cfg["micro_batches"], on_gpu=True, seq_len=lay_cfg["seq_len"])
        device_gib = peer["published"]["peak_memory_gib"] / (peer["published"]["peak_memory_pct"] / 100)
        hw = Hardware(
            site="H100 80GB (prime-rl's node)",
            partition="-",
            gpus_per_node=8,
            device_memory_gib=device_gib,
            peak_tflops=989,
            memory_gbps=3350,
            intra_node_gbps=450,
            inter_node_gbps=None,
            charge_per_node_hour=None,
            charge_unit="-",
            mfu=0.25,
            bandwidth_efficiency=0.6,
            memory_margin=0.1,
            filesystem_gbps=2.0,
            ranks_per_node=8,
        )
        step = train_step(arch, lay, hw, tokens=tokens_micro * lay.ranks, seq_len=lay_cfg["seq_len"], micro_batches=1)
        mfu_match = peer["published"]["mfu_pct"] / 100
        out.append(
            {
                **peer,
                "model": {"params_total": arch.total, "params_active": arch.active, "source": QWEN3_30B_A3B["source"]},
                "planned": {
                    "peak_memory_gib": round(mem["peak"] / GIB, 2),
                    "parts_gib": {k: round(v / GIB, 2) for k, v in mem["parts"].items()},
                    "ratio_to_published_memory": round(mem["peak"] / GIB / peer["published"]["peak_memory_gib"], 3),
                    "step_time_per_micro_batch_s": round(step["step_s"], 3),
                    "step_assumes": step["assumes"]
                    + " (H100 SXM: 989 TFLOP/s dense bf16, NVLink 450 GB/s per direction, unverified here)",
                    "device_memory_gib": round(device_gib, 2),
                    "device_memory_from": "published peak GiB / published percent",
                    "mfu_that_matches_published_step": round(0.25 * step["step_s"] / peer["published"]["step_time_s"], 4),
                    "published_mfu_for_comparison": mfu_match,
                },
            }
        )
    return out


def snowball() -> dict:
    """The Snowball layout from the seeds (../shared/seeds/snowball-smartie-rl-model-card.txt): policy
    TP1/PP2/EP16 on 64 H100 GPUs plus 48 inference GPUs. Against the `snowball-67b-a2b` preset."""
    arch = Arch("snowball-67b-a2b", PRESETS["snowball-67b-a2b"])

    class _Stage:  # the Parallelism keys make_layout reads
        backend, tensor_parallel, pipeline_parallel, expert_parallel = "megatron", 1, 2, 16
        zero_stage, master_dtype, compute_dtype, activation_checkpointing = 1, "float32", "auto", True

    published = {
        "layout": "policy: tensor parallelism 1, pipeline parallelism 2, expert parallelism 16 on 64 H100 GPUs; 48 separate inference GPUs",
        "batch": "512 accepted prompt groups per update, 16 responses per group",
        "source": "/work/shared/seeds/snowball-smartie-rl-model-card.txt (the Snowball Smartie RL model card)",
        "memory_or_step_time": "not published",
    }
    out = {"published": published, "model": arch.describe()}
    try:
        make_layout(_Stage, 64, "snowball", arch, on_gpu=True)
        out["preset_accepts_layout"] = True
    except UserError as e:
        out["preset_accepts_layout"] = False
        out["refused"] = str(e)
    _Stage.expert_parallel = 8  # the nearest that divides the preset's 376 experts
    lay = make_layout(_Stage, 64, "snowball", arch, on_gpu=True)
    mem = trainer_memory(arch, lay, 8192, 8, on_gpu=True, seq_len=8192)
    out["planned_with_ep8"] = {
        "layout": lay.describe(),
        "tokens_per_micro_batch_per_rank": 8192,
        "peak_memory_gib": round(mem["peak"] / GIB, 2),
        "parts_gib": {k: round(v / GIB, 2) for k, v in mem["parts"].items()},
        "fits_h100_80gb_with_10pct_margin": mem["peak"] / GIB <= 74.5 * 0.9,
        "note": "one 8192-token row per rank per micro batch, 8 micro batches, float32 masters, bf16 compute: assumptions, not published",
    }
    return out


def _calibration(source: str, site: str) -> dict:
    """Fit on a run directory (its points kept beside it, in RUN/plan/calibration-points.json) or on
    points saved from one."""
    path = Path(source)
    if path.is_dir():
        points = calibration_points(str(path), site)
        atomic_write_json(path / "plan" / "calibration-points.json", points)
    else:
        points = json.loads(path.read_text())
    return calibrate(points)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench plan-validation", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--measured", action="append", default=[], help="a `snowcat bench trainer-memory --json` result (LABEL=FILE or FILE)"
    )
    ap.add_argument("--activations", action="append", default=[], help="a `snowcat bench activation-count --json` result")
    ap.add_argument(
        "--run-compare",
        action="append",
        default=[],
        metavar="LABEL=RUN",
        help="a finished run that `snowcat plan --compare RUN` has compared (the run, or its plan/compare.json)",
    )
    ap.add_argument(
        "--conditions",
        action="append",
        default=[],
        metavar="LABEL=TEXT",
        help="--run-compare LABEL: the conditions it ran under (e.g. the load average), recorded beside it",
    )
    ap.add_argument(
        "--calibrate",
        metavar="RUN|POINTS.json",
        help="fit the local site's time constants on a finished run (its directory, or the points a run gave)",
    )
    ap.add_argument("--site", default="local", help="--calibrate: the site profile the run is planned on")
    ap.add_argument("--json", help="write the side-by-side here")
    args = ap.parse_args(argv)
    if not args.measured:
        raise UserError("--measured: give at least one trainer-memory result")
    conditions = dict(item.split("=", 1) for item in args.conditions)
    cpu = []
    for item in args.measured:
        label, sep, path = item.partition("=")
        path = path if sep else label
        cpu.append(cpu_memory(json.loads(Path(path).read_text()), label if sep else Path(path).stem))
    result = {
        "benchmark": "plan-validation",
        "what": __doc__.splitlines()[0],
        "target": f"planned peak within {TARGET:.0%} of measured for the modes {', '.join(MODELLED)}",
        "cpu_memory": cpu,
        "activation_count": [activation_row(json.loads(Path(path).read_text())) for path in args.activations],
        "calibration": _calibration(args.calibrate, args.site) if args.calibrate else None,
        "run_compare": [run_compare(*item.split("=", 1), conditions.get(item.split("=", 1)[0])) for item in args.run_compare],
        "peers": peer_rows(),
        "snowball": snowball(),
        "command": " ".join(["snowcat", "bench", "plan-validation", *(argv if argv is not None else sys.argv[1:])]),
    }
    for block in cpu:
        print(f"{block['label']}: {block['tokens_per_rank']} tokens per rank")
        for mode, r in block["modes"].items():
            flag = "ok" if r["within_15pct"] else ("OUT" if r["claimed"] else "(not claimed)")
            print(
                f"  {mode:<9} planned {r['planned_mib']:>8.1f} MiB  measured {r['measured_mib']:>8.1f} MiB  x{r['ratio']:.3f}  {flag}"
            )
    for a in result["activation_count"]:
        print(
            f"activations at {a['tokens']} tokens: saved {a['saved_mib']} MiB, planned {a['planned_mib']} MiB (x{a['ratio']});"
            f" backward peak {a['backward_peak_mib']} MiB, planned {a['planned_backward_mib']} MiB (x{a['backward_ratio']})"
        )
    if cal := result["calibration"]:
        print(
            f"calibrated on {cal['run']}: mfu {cal['mfu']}, job_start_s {cal['job_start_s']}, decode_step_s {cal['decode_step_s']}, "
            f"decode_token_s {cal['decode_token_s']}, stage_work_s {cal['stage_work_s']}"
        )
    for c in result["run_compare"]:
        for r in c["stages"]:
            print(f"{c['label']} {r['stage']}: step s {r['step_s']}, node-hours {r['node_hours']}")
        print(f"{c['label']} total node-hours {c['total_node_hours']}; outside 15%: {', '.join(c['misses']) or 'none'}")
    for p in result["peers"]:
        print(
            f"{p['name']}: planned {p['planned']['peak_memory_gib']} GiB, published {p['published']['peak_memory_gib']:.2f} GiB"
        )
    sb = result["snowball"]
    print(
        f"snowball: preset accepts the published layout: {sb['preset_accepts_layout']}; EP8: {sb['planned_with_ep8']['peak_memory_gib']} GiB"
    )
    if args.json:
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
