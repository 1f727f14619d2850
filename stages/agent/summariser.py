"""A stage's context policy from its config's `context` section (stages/agent/context.py), with the
helper model that writes its summaries served by the stage's engine. Apart from context.py, which the
agent loop imports: serving a model needs torch, the loop's importers (the CLI's trace report) do not."""

from __future__ import annotations

from snowcat.pipeline.errors import UserError
from snowcat.stages.agent.context import Helper, Summarise
from snowcat.stages.rollout import SamplingParams, serve_model_dir
from snowcat.stages.train.backend import local_device


def context_policy(ctx, cfg, key: str):
    """The context policy of a stage config's `context` section (stages.config.ContextConfig): None
    to keep everything, else `Summarise`, with its helper model served by the stage's engine."""
    c = cfg.context
    if c.policy == "keep":
        return None
    helper = None
    if c.summariser != "policy":
        path = ctx.checkpoint(c.summariser, "context.summariser")
        engine, tok, model_cfg = serve_model_dir(
            path, cfg.engine, vllm=cfg.vllm, max_batch=1, device=local_device(ctx.local_rank), seed=ctx.seed
        )
        if tok is None:
            raise UserError(f"{key}.summariser: {c.summariser!r} has no tokenizer")
        limit = int(model_cfg.max_position_embeddings)
        if limit <= c.max_tokens:
            raise UserError(f"{key}.max_tokens: {c.max_tokens} leaves no room in the helper's {limit} positions")
        params = SamplingParams(temperature=c.summariser_temperature)
        helper = Helper(engine, tok, params, limit, name=c.summariser)
    return Summarise(c.at_tokens, c.keep_turns, c.max_tokens, c.timeout_s, helper, request=c.request)
