"""Agent rollouts: the trajectory record, the multi-turn agent loop, and tool environments.

from snowcat.stages.agent import Trajectory, pack, unpack           # trajectory.py (numpy only)
from snowcat.stages.agent import run_episodes, EpisodeJob, Budget   # loop.py
from snowcat.stages.agent import SingleTurnEnv, CalculatorEnv, make_env, teacher_messages  # envs.py
"""

from snowcat.stages.agent.envs import CalculatorEnv, SingleTurnEnv, Step, calculate, make_env, teacher_messages
from snowcat.stages.agent.loop import Budget, EpisodeJob, episode_seed, run_episodes
from snowcat.stages.agent.trajectory import FIELDS, STATUSES, Trajectory, allocate, header, pack, unpack

__all__ = [
    "FIELDS",
    "STATUSES",
    "Trajectory",
    "allocate",
    "header",
    "pack",
    "unpack",
    "Budget",
    "EpisodeJob",
    "episode_seed",
    "run_episodes",
    "CalculatorEnv",
    "SingleTurnEnv",
    "Step",
    "calculate",
    "make_env",
    "teacher_messages",
]
