"""Prompt selection (stages/prompts.py, docs/recipes.md): K candidate prompts scored on development
tasks with a checkpoint, one chosen with evaluate's paired statistics, a preempted stage resumed to
the bytes of an uninterrupted one, and the choice named by reference in `rl.rollout_prompt`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_agent import overfit, tiny_model

import snowcat.stages.prompts as prompts
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.reports import card as card_mod
from snowcat.stages import evalstats
from snowcat.stages.agent import Budget, SingleTurnEnv
from snowcat.stages.agent.prompting import PromptedEnv, PromptError, resolve_rollout_prompt
from snowcat.stages.config import PromptsConfig, RlConfig
from snowcat.stages.model import load_model_dir, save_model_dir
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.scoring import play_attempts
from snowcat.stages.taskgen import generate_domain, save_tasks, verify
from snowcat.stages.tokenizer import train_tokenizer
from tests.conftest import write_config

# one worker builds the module's model and runs once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("recipes_prompts")

P = "Answer with the result only."
Q = "Check every digit twice."
CANDIDATES = ["", P, Q]
SMALL = {
    "checkpoint": "sft:final",
    "candidates": CANDIDATES,
    "rule": "best",
    "attempts": 2,
    "max_tokens": 8,
    "max_context": 64,
    "verifier_timeout_s": 0,  # in this process: no verifier worker to start
    "bootstrap_samples": 200,
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """tasks/dev.parquet (10 arith tasks) and sft/checkpoints/final: a micro model that learnt eight of
    them with prompt P as a system message and two without, so the prompt matters to it."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("prompts_inputs")
    tasks = generate_domain(np.random.default_rng(7), "arith", [2], 10)
    save_tasks(root / "tasks", "dev", tasks)
    tok = train_tokenizer(([t.prompt for t in tasks] + [t.answer for t in tasks] + [P, Q] * 4) * 2, vocab_size=300)
    plain = [[{"role": "user", "content": t.prompt}, {"role": "assistant", "content": t.answer}] for t in tasks]
    demos = [[{"role": "system", "content": P}, *d] for d in plain[:8]] + plain[8:]
    model = overfit(tiny_model(tok, seed=1), tok, demos, max_steps=80)
    save_model_dir(root / "sft" / "checkpoints" / "final", model, tok)
    return root


class _PreemptAfter(StageContext):
    """The end of the job is announced at the first poll (after the first candidate)."""

    def checkpoint_due(self) -> bool:
        return True


def make_ctx(inputs: Path, run_dir: Path, cls=StageContext, **over) -> StageContext:
    return cls.standalone(
        "prompts",
        {**SMALL, **over},
        run_dir=run_dir,
        inputs={"tasks": inputs / "tasks", "sft": inputs / "sft"},
        name="pick",
        seed=11,
    )


@pytest.fixture(scope="module")
def straight(inputs, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("prompts_run")
    prompts.run(make_ctx(inputs, run_dir))
    return run_dir


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "pick" / "prompts.json").read_text())


def test_each_candidate_is_scored_with_its_prompt_in_the_opening_and_the_best_chosen(inputs, straight):
    """The counts are those of the candidate's own episodes played apart (the prompt as a system
    message, the stage's seed for every candidate); the statistics are evalstats' on those counts."""
    got = report(straight)
    model, _, tok = load_model_dir(inputs / "sft" / "checkpoints" / "final")
    tasks = prompts.load_tasks(inputs / "tasks", "dev")
    params = SamplingParams(1.0, 0, 1.0, 8, (tok.end_of_turn_id,))
    rates = []
    for k, prompt in enumerate(CANDIDATES):
        env = PromptedEnv(SingleTurnEnv(tok), prompt) if prompt else SingleTurnEnv(tok)
        records, _ = play_attempts(
            TorchEngine(model), tok, tasks, env, params, Budget(64, 8, 1), attempts=2, seed=11, verifier=verify
        )
        counts = {t.task_id: [0, 0, 0] for t in tasks}
        for r in records:
            counts[r.task.task_id][0] += 1
            counts[r.task.task_id][1] += r.passed
        assert got["per_task"][str(k)] == counts, prompt
        rates.append([c[1] / c[0] for c in counts.values()])
        assert got["candidates"][k]["pass@1"] == pytest.approx(np.mean(rates[-1]))
        assert got["candidates"][k]["sha256"] == prompts.digest(prompt)
    assert len({tuple(r) for r in rates}) == 3  # the prompt changes what the model does
    for v in got["versus_baseline"]:
        diff, se = evalstats.paired_difference(rates[0], rates[v["index"]])
        assert (v["diff"], v["se"]) == (pytest.approx(diff), pytest.approx(se))
    p = [v["p"] for v in got["versus_baseline"]]
    assert [v["p_holm"] for v in got["versus_baseline"]] == pytest.approx(evalstats.holm(p), nan_ok=True)
    best = int(np.argmax([np.mean(r) for r in rates]))
    assert got["chosen"] == {
        "index": best,
        "prompt": CANDIDATES[best],
        "sha256": prompts.digest(CANDIDATES[best]),
        "reason": got["chosen"]["reason"],
    }
    assert best == 1  # P, the prompt the model learnt its answers under


def test_a_preempted_stage_resumes_to_the_bytes_of_an_uninterrupted_one(inputs, straight, tmp_path):
    with pytest.raises(Preempted, match="1 of 3 candidates"):
        prompts.run(make_ctx(inputs, tmp_path, _PreemptAfter))
    assert sorted(p.name for p in (tmp_path / "pick" / "partial").iterdir()) == ["candidate_000.json"]
    prompts.run(make_ctx(inputs, tmp_path))
    assert (tmp_path / "pick" / "prompts.json").read_bytes() == (straight / "pick" / "prompts.json").read_bytes()
    assert not (tmp_path / "pick" / "partial").exists()


def test_rl_rollout_prompt_names_the_choice_by_reference(straight):
    assert resolve_rollout_prompt("prompts:pick", {"pick": straight / "pick"}, "stages.rl.rollout_prompt") == P
    assert resolve_rollout_prompt(P, {}, "stages.rl.rollout_prompt") == P  # a text is itself
    with pytest.raises(UserError, match=r"^stages\.rl\.rollout_prompt: 'prompts:other' names stage 'other'"):
        resolve_rollout_prompt("prompts:other", {"pick": straight / "pick"}, "stages.rl.rollout_prompt")
    card = card_mod.training._rl_recipe_lines(RlConfig(rollout_prompt="prompts:pick"))[-1]
    assert "prompt-selection stage `pick` chose" in card  # the card names the chooser, not a digest of the reference
    # an unresolved reference is never sampled with as if it were the prompt's text
    with pytest.raises(PromptError, match="names a prompt-selection stage"):
        PromptedEnv(SingleTurnEnv(None), "prompts:pick")


def counts_for(passes: list[list[int]], n: int = 4) -> list[dict]:
    """Per candidate, task -> [n scored, passes, 0 infra]."""
    return [{f"t{i}": [n, p, 0] for i, p in enumerate(row)} for row in passes]


def test_the_significant_rule_takes_the_best_candidate_whose_gain_survives_holm():
    """Candidate 1 has the highest pass@1 but on a few tasks (no significant gain); candidate 2 gains a
    little on every task but one (significant): `significant` takes 2, `best` takes 1; with no
    significant gain the baseline stays."""
    base = [0, 1, 2, 1, 0, 2, 1, 0, 1, 2, 0, 1]
    lucky = [4, 1, 2, 1, 4, 2, 1, 4, 1, 2, 0, 1]  # +4 on three tasks
    steady = [b + 1 for b in base[:-1]] + [base[-1]]  # +1 on eleven tasks
    cfg = PromptsConfig(candidates=["", "lucky", "steady"], bootstrap_samples=200)
    out = prompts.choose(cfg.candidates, counts_for([base, lucky, steady]), cfg, seed=0)
    v = {x["index"]: x for x in out["versus_baseline"]}
    assert out["candidates"][1]["pass@1"] > out["candidates"][2]["pass@1"]
    assert v[2]["significant"] and not v[1]["significant"] and out["chosen"]["index"] == 2
    assert v[2]["p"] < v[1]["p"] and v[2]["p_holm"] == pytest.approx(2 * v[2]["p"])  # Holm over the two comparisons
    assert v[1]["p_holm"] == pytest.approx(v[1]["p"]) and v[1]["p"] >= cfg.alpha  # its higher mean rests on three tasks
    cfg.rule = "best"
    assert prompts.choose(cfg.candidates, counts_for([base, lucky, steady]), cfg, seed=0)["chosen"]["index"] == 1
    cfg.rule = "significant"
    plain = prompts.choose(cfg.candidates, counts_for([base, lucky, base]), cfg, seed=0)
    assert plain["chosen"]["index"] == 0 and "no candidate's gain" in plain["chosen"]["reason"]


def test_infrastructure_failures_leave_the_denominators():
    cfg = PromptsConfig(candidates=["", "x"], bootstrap_samples=50)
    counts = [{"a": [2, 2, 2], "b": [4, 0, 0]}, {"a": [0, 0, 4], "b": [4, 1, 0]}]
    out = prompts.choose(cfg.candidates, counts, cfg, seed=0)
    assert out["candidates"][0]["pass@1"] == 0.5 and out["candidates"][0]["infra_failures"] == 2
    assert out["candidates"][1]["pass@1"] == 0.25 and out["candidates"][1]["tasks"] == 1  # task a: nothing scored
    assert out["versus_baseline"][0]["tasks"] == 1


def _load(tmp_path, prompts_section: str, rl_extra: str = "") -> None:
    path = write_config(
        tmp_path / "p.yaml",
        "name: x\nstages:\n"
        "  tasks: {kind: tasks, domains: {arith: {count: 100, val_count: 10, dev_count: 10, difficulties: [2]}}}\n"
        "  sft: {kind: sft, needs: [tasks]}\n"
        f"  pick: {{kind: prompts, needs: [tasks, sft], {prompts_section}}}\n"
        f"  rl: {{kind: rl, needs: [tasks, sft{rl_extra}], rollout_prompt: 'prompts:pick'}}\n",
    )
    config_mod.load(path)


@pytest.mark.parametrize(
    "section, rl_extra, message",
    [
        ("candidates: ['a', 'b']", "", "stages.rl.needs: add 'pick' (named in rollout_prompt)"),
        ("candidates: ['a']", ", pick", "stages.pick.candidates: name at least 2 prompts"),
        ("candidates: ['a', 'a']", ", pick", "stages.pick.candidates: a prompt is listed twice"),
        ("candidates: ['a', 'b'], baseline: 2", ", pick", "stages.pick.baseline: 2 is not a candidate's index"),
        ("candidates: ['a', 'b'], split: train", ", pick", "stages.pick.split: the tasks RL trains on"),
    ],
)
def test_bad_prompt_selection_config_is_refused_at_load_naming_the_key(tmp_path, section, rl_extra, message):
    with pytest.raises(UserError) as e:
        _load(tmp_path, section, rl_extra)
    assert f": {message}" in str(e.value)


def test_a_reference_to_a_stage_that_is_not_a_prompts_stage_is_refused(tmp_path):
    path = write_config(
        tmp_path / "p.yaml",
        "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
        "  rl: {kind: rl, needs: [tasks, sft], rollout_prompt: 'prompts:sft'}\n",
    )
    with pytest.raises(UserError) as e:
        config_mod.load(path)
    assert str(e.value) == f"{path}: stages.rl.rollout_prompt: stage 'sft' is a sft stage, not a prompts stage"
    path = write_config(
        tmp_path / "q.yaml",
        "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
        "  pick: {kind: prompts, needs: [tasks, sft], candidates: ['', 'a']}\n",
    )
    with pytest.raises(UserError) as e:
        config_mod.load(path)
    assert "stages.pick.split: stage 'tasks' holds out no dev split" in str(e.value)
