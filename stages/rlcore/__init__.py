"""Parts of the RL stage: weight handoff, trajectory transport, the trainer's loss and loop.

handoff.py    trainer publishes weights/step_N (manifest + STABLE); rollout loads exactly step k - lag
transport.py  one typed message per batch (send_batch / recv_batch): MPITransport and FileQueueTransport
objective.py  advantages, padded batches, the TIS policy loss under the sampling distribution
trainer.py    the trainer role (`Trainer`): resume, update, publish, log, evaluate, checkpoint
preempt.py    preemption across ranks: the trainer saves while rollout ranks wait, then all leave
episodes.py   batch k's episodes through stages.agent.run_episodes
"""
