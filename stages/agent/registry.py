"""Environments by name (the `env:` key of probe and RL), and the teacher demonstration of a task in each."""

from __future__ import annotations

from snowcat.stages.agent.envs import CalculatorEnv, SingleTurnEnv, calculate
from snowcat.stages.agent.repo_env import RepoEnv, teacher_episode

ENVS = {SingleTurnEnv.name: SingleTurnEnv, CalculatorEnv.name: CalculatorEnv, RepoEnv.name: RepoEnv}


def make_env(name: str, tokenizer, **options):
    try:
        cls = ENVS[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; expected one of {sorted(ENVS)}") from None
    return cls(tokenizer, **options)


def teacher_messages(
    task,
    env_name: str,
    tool_domains: tuple[str, ...] = ("arith",),
    detour: bool = False,
    explore: bool = False,
    **repo_options,
) -> list[dict]:
    """The demonstration of `task` in environment `env_name` as chat messages (for SFT's encode_chat).
    Repository tasks are demonstrated in RepoEnv (made with `repo_options`: the sandbox image and
    observation size must match the rollouts') whatever `env_name` says: they have no other protocol
    (`detour`: the expert opens a wrong file first; `explore`: it reads the test module; `teacher_episode`)."""
    if env_name not in ENVS:
        raise ValueError(f"unknown environment {env_name!r}; expected one of {sorted(ENVS)}")
    if task.verifier == "repo":
        return teacher_episode(task, RepoEnv(None, **repo_options), detour, explore)
    if env_name == CalculatorEnv.name and task.domain in tool_domains:
        expr = task.prompt.rstrip().removesuffix("=")
        return [
            {"role": "user", "content": task.prompt},
            {"role": "assistant", "content": f"<tool_call>{expr}</tool_call>"},
            {"role": "tool", "content": str(calculate(expr))},
            {"role": "assistant", "content": task.answer},
        ]
    return task.messages()
