"""Agent rollouts: the trajectory record, the multi-turn agent loop, and tool environments.

    from stages.agent import Trajectory, pack, unpack           # trajectory.py (numpy only)
    from stages.agent import run_episodes, EpisodeJob, Budget   # loop.py
    from stages.agent import SingleTurnEnv, CalculatorEnv, make_env, teacher_messages  # envs.py
"""

from stages.agent.envs import CalculatorEnv, SingleTurnEnv, Step, calculate, make_env, teacher_messages
from stages.agent.loop import Budget, EpisodeJob, episode_seed, run_episodes
from stages.agent.trajectory import FIELDS, STATUSES, Trajectory, allocate, header, pack, unpack

__all__ = [
    "FIELDS", "STATUSES", "Trajectory", "allocate", "header", "pack", "unpack",
    "Budget", "EpisodeJob", "episode_seed", "run_episodes",
    "CalculatorEnv", "SingleTurnEnv", "Step", "calculate", "make_env", "teacher_messages",
]
