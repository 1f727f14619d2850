"""Agent rollouts: the trajectory record, the multi-turn agent loop, and tool environments.

from snowcat.stages.agent import Trajectory, TrajectoryBatch, BatchBuffers, encode, decode  # trajectory.py (numpy only)
from snowcat.stages.agent import run_episodes, run_batch, EpisodeJob, Budget       # loop.py
from snowcat.stages.agent import SingleTurnEnv, CalculatorEnv                      # envs.py
from snowcat.stages.agent import RepoEnv, behaviour                                # repo_env.py
from snowcat.stages.agent import make_env, teacher_messages                        # registry.py
"""

from snowcat.stages.agent.envs import CalculatorEnv, SingleTurnEnv, Step, calculate
from snowcat.stages.agent.loop import Budget, EpisodeJob, episode_seed, run_batch, run_episodes
from snowcat.stages.agent.registry import make_env, teacher_messages
from snowcat.stages.agent.repo_env import RepoEnv, behaviour
from snowcat.stages.agent.trajectory import (
    FIELDS,
    STATUSES,
    WIRE_VERSION,
    BatchBuffers,
    Trajectory,
    TrajectoryBatch,
    decode,
    encode,
    pack,
    unpack,
)

__all__ = [
    "FIELDS",
    "STATUSES",
    "WIRE_VERSION",
    "BatchBuffers",
    "Trajectory",
    "TrajectoryBatch",
    "decode",
    "encode",
    "pack",
    "unpack",
    "Budget",
    "EpisodeJob",
    "episode_seed",
    "run_batch",
    "run_episodes",
    "CalculatorEnv",
    "RepoEnv",
    "behaviour",
    "SingleTurnEnv",
    "Step",
    "calculate",
    "make_env",
    "teacher_messages",
]
