"""Agent rollouts: the trajectory record, the multi-turn agent loop, and tool environments.

`from stages.agent import Trajectory, pack, unpack` -- see trajectory.py (no torch needed);
`run_episodes`, `EpisodeJob`, `Budget` in loop.py; `SingleTurnEnv`, `CalculatorEnv`,
`make_env`, `teacher_messages` in envs.py.
"""

from stages.agent.trajectory import FIELDS, STATUSES, Trajectory, allocate, header, pack, unpack

__all__ = ["FIELDS", "STATUSES", "Trajectory", "allocate", "header", "pack", "unpack"]
