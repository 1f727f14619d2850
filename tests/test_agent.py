"""Trajectory packing, the agent loop with a real (tiny, random) model, and the tool environments."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snowcat.stages.agent import (
    FIELDS,
    STATUSES,
    WIRE_VERSION,
    Budget,
    CalculatorEnv,
    EpisodeJob,
    Trajectory,
    calculate,
    decode,
    encode,
    make_env,
    pack,
    run_episodes,
    teacher_messages,
    unpack,
)
from snowcat.stages.agent.envs import CalcError, tool_message_ids
from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.taskgen import generate_domain
from snowcat.stages.tokenizer import train_tokenizer


@st.composite
def trajectories(draw):
    n = draw(st.integers(0, 12))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    lps = [-draw(st.floats(0, 20, width=32)) if m else 0.0 for m in mask]
    spans = sorted(draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), max_size=3)))
    # the engine's kept support (top-k / top-p) or none (full distribution), router replay or none
    support = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) if draw(st.booleans()) else None
    width = draw(st.sampled_from([None, 1, 6]))
    return Trajectory(
        task_id=draw(st.text(max_size=12)),
        group_id=draw(st.integers(0, 2**40)),
        attempt=draw(st.integers(0, 64)),
        policy_version=draw(st.integers(0, 10**6)),
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        loss_mask=mask,
        rollout_logprobs=lps,
        reward=draw(st.floats(0, 1)),
        status=draw(st.sampled_from(STATUSES)),
        turn_boundaries=spans,
        domain=draw(st.sampled_from(["arith", "closure", "ünïcode", ""])),
        prompt_len=draw(st.integers(0, n)),
        detail=draw(st.text(max_size=20)),
        support_lengths=support,
        support_ids=None
        if support is None
        else draw(st.lists(st.integers(0, 2**31 - 1), min_size=sum(support), max_size=sum(support))),
        routes=None
        if width is None
        else np.array(draw(st.lists(st.integers(-1, 127), min_size=n * width, max_size=n * width)), np.int16).reshape(n, width),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # shared, loaded CI cores
@given(st.lists(trajectories(), max_size=5), st.integers(0, 2**40))
def test_pack_and_the_one_buffer_wire_round_trip_every_field(trajs, k):
    bufs = pack(trajs)
    assert list(bufs) == list(FIELDS)
    for name, (dtype, tail) in FIELDS.items():
        assert bufs[name].dtype == dtype and bufs[name].shape[1:] == tail
        assert bufs[name].flags.c_contiguous
    assert unpack(bufs) == trajs
    wire = encode(k, trajs)
    assert wire.dtype == np.uint8 and wire.ndim == 1 and len(wire) % 8 == 0
    got_k, got = decode(wire)
    assert got_k == k and got == trajs
    # every field as it was, the optional ones too (None stays None, empty stays empty)
    for a, b in zip(trajs, got):
        assert (a.routes is None) == (b.routes is None) and len(a.support_ids) == len(b.support_ids)
        for name, (dtype, _tail) in FIELDS.items():
            value = getattr(b, name, None)
            assert value is None or not isinstance(value, np.ndarray) or value.dtype == dtype
    assert decode(bytes(wire))[1] == trajs  # from any buffer: bytes as a file or a socket gives them


def test_decoded_trajectories_are_independent_records():
    trajs = [
        Trajectory(
            "a", 0, 0, 1, [1, 2, 3], [0, 1, 1], [0, -0.5, -1], 1.0, "ok", [(1, 3)], "arith", 1, routes=[[0, 1], [2, 3], [4, 5]]
        ),
        Trajectory("b", 0, 1, 1, [4, 5], [0, 1], [0, -2], 0.0, "truncated", [(1, 2)], "arith", 1, routes=[[6, 7], [0, 1]]),
    ]
    _, (a, b) = decode(encode(0, trajs))
    a.token_ids[:] = 9  # views of one received buffer, but disjoint: writing one record leaves the other
    a.routes[:] = -1
    assert b.token_ids.tolist() == [4, 5] and b.routes.tolist() == [[6, 7], [0, 1]]


def test_decode_refuses_what_is_not_this_wire_format():
    trajs = [Trajectory("t", 0, 0, 0, [1, 2], [0, 1], [0.0, -1.0], 1.0, "ok", [(1, 2)], "arith", 1)]
    wire = encode(5, trajs)
    with pytest.raises(ValueError, match="shorter than its"):
        decode(wire[:16])
    with pytest.raises(ValueError, match="header describes"):
        decode(wire[:-8])  # truncated
    other = wire.copy()
    other[8:16].view(np.int64)[0] = WIRE_VERSION + 1
    with pytest.raises(ValueError, match=f"wire format version {WIRE_VERSION + 1}"):
        decode(other)
    other = wire.copy()
    other[:8] = 0
    with pytest.raises(ValueError, match="no magic number"):
        decode(other)
    bufs = pack(trajs)
    bufs["token_offsets"] = np.array([0, 3], np.int64)  # offsets past the tokens
    with pytest.raises(ValueError, match="token_offsets"):
        unpack(bufs)
    bufs = pack(trajs)
    bufs["status"] = np.array([len(STATUSES)], np.uint8)
    with pytest.raises(ValueError, match="status"):
        unpack(bufs)


def test_one_message_per_batch_over_mpi():
    MPI = pytest.importorskip("mpi4py.MPI")
    trajs = [
        Trajectory("arith-d2-x", 7, 1, 3, [5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -0.5, -1.25], 1.0, "ok", [(2, 4)], "arith", 2),
        Trajectory("closure-d1-y", 8, 0, 3, [5, 9], [0, 1], [0, -2.0], 0.0, "truncated", [(1, 2)], "closure", 1),
    ]
    comm = MPI.COMM_SELF
    req = comm.Isend([encode(4, trajs), MPI.BYTE], dest=0, tag=0)
    status = MPI.Status()
    msg = comm.Mprobe(source=0, tag=0, status=status)  # the size comes with the one message
    buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    msg.Recv([buf, MPI.BYTE])
    req.Wait()
    assert decode(buf) == (4, trajs)


def test_trajectory_rejects_bad_shapes_and_status():
    with pytest.raises(ValueError, match="status"):
        Trajectory("t", 0, 0, 0, [1], [1], [0.0], 0.0, "crashed")
    with pytest.raises(ValueError, match="mask"):
        Trajectory("t", 0, 0, 0, [1, 2], [1], [0.0, 0.0], 0.0, "ok")


# ---------------------------------------------------------------- a tiny real world: tasks, BPE, MoE model


def tiny_tasks(count: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    return generate_domain(rng, "arith", [2], count), generate_domain(rng, "closure", [2], count)


def tiny_tokenizer(tasks):
    texts = [t.prompt for t in tasks] + [t.answer for t in tasks] + ["turn cut at tokens; answer briefly"]
    return train_tokenizer(texts * 2, vocab_size=300)


def tiny_model(tok, seed: int = 0):
    torch.manual_seed(seed)
    return MoEForCausalLM(dataclasses.replace(PRESETS["test-micro"], vocab_size=tok.vocab_size)).eval()


def overfit(model, tok, conversations: list[list[dict]], max_steps: int = 200):
    """Teach `model` the demonstrations by heart (full-batch AdamW on the assistant tokens)."""

    encoded = [tok.encode_chat(c) for c in conversations]
    width = max(len(i) for i, _ in encoded)
    ids = torch.full((len(encoded), width), tok.pad_id)
    targets = torch.full((len(encoded), width), -100)
    for b, (i, m) in enumerate(encoded):
        ids[b, : len(i)] = torch.tensor(i)
        targets[b, : len(i) - 1] = torch.tensor([t if keep else -100 for t, keep in zip(i[1:], m[1:])])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        logits = model.logits(model(ids).hidden)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.005:
            break
    return model.eval()


@pytest.fixture(scope="module")
def world():
    arith, closure = tiny_tasks()
    return arith, closure, tiny_tokenizer(arith + closure)


@pytest.fixture(scope="module")
def calculator_model(world):
    """A micro model that learned the calculator protocol on four arith tasks."""
    arith, _, tok = world
    return overfit(tiny_model(tok), tok, [teacher_messages(t, "calculator") for t in arith[:4]])


def engine_for(model):
    return TorchEngine(model, max_batch=8)


# ---------------------------------------------------------------- the calculator and the environments


@pytest.mark.parametrize(
    "expr,value", [("37+45", 82), ("2*(3+4)-5", 9), ("-3*-3", 9), (" 10 - 2 - 3 ", 5), ("007", 7), ("((1))", 1)]
)
def test_calculator_evaluates_integer_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr", ["", "2**3", "1/2", "(1+2", "1+", "__import__('os')", "1e3", "3 4", "9" * 41 + "*1", "99999999999*" * 5 + "9"]
)
def test_calculator_rejects_anything_else(expr):
    with pytest.raises(CalcError):
        calculate(expr)


def test_rollout_layout_equals_the_teacher_demonstration(world):
    """Prompt + tool-call turn + env observation + answer turn is exactly encode_chat(teacher):
    SFT on teacher_messages teaches the protocol the agent loop speaks."""
    arith, _, tok = world
    task = arith[0]
    env = CalculatorEnv(tok)
    msgs = teacher_messages(task, "calculator")
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    teacher_ids, teacher_mask = tok.encode_chat(msgs)
    call = tok.encode(msgs[1]["content"]) + [tok.end_of_turn_id]
    answer = tok.encode(task.answer) + [tok.end_of_turn_id]
    assert call[0] == tok.tool_call_start_id and call[-2] == tok.tool_call_end_id
    state = env.reset(task)
    step = env.step(task, state, call)
    assert not step.done and state["calls"] == 1
    final = env.step(task, state, answer)
    assert final.done and final.answer == task.answer and final.reward is None
    rollout = env.prompt(task) + call + step.observation + answer
    assert rollout == teacher_ids
    # what the loop trains (the model's turns) is what SFT trains (assistant content + <|end|>)
    trained = [i for i, m in zip(teacher_ids, teacher_mask) if m]
    assert trained == call + answer
    assert teacher_messages(task, "single") == task.messages()


def test_calculator_env_statuses(world):
    arith, closure, tok = world
    env = make_env("calculator", tok)
    task = arith[0]
    call = [tok.tool_call_start_id] + tok.encode("2*(3+4)") + [tok.tool_call_end_id, tok.end_of_turn_id]
    step = env.step(task, env.reset(task), call)
    assert step.observation == tool_message_ids(tok, "14")
    unclosed = [tok.tool_call_start_id] + tok.encode("1+2") + [tok.end_of_turn_id]
    assert env.step(task, env.reset(task), unclosed).status == "invalid_action"
    garbage = [tok.tool_call_start_id] + tok.encode("1/2") + [tok.tool_call_end_id]
    assert env.step(task, env.reset(task), garbage).status == "invalid_action"
    # answering without the tool: reward 0 when required, verifier's call otherwise and off-domain
    direct = tok.encode(task.answer) + [tok.end_of_turn_id]
    assert env.step(task, env.reset(task), direct).reward == 0.0
    assert make_env("calculator", tok, require_tool=False).step(task, {"calls": 0}, direct).reward is None
    other = closure[0]
    assert env.step(other, env.reset(other), tok.encode(other.answer)).reward is None
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("browser", tok)


# ---------------------------------------------------------------- the loop


def test_learned_calculator_protocol_end_to_end(world, calculator_model):
    arith, _, tok = world
    tasks = arith[:4]
    jobs = [EpisodeJob(t, group_id=i, attempt=0) for i, t in enumerate(tasks)]
    trajs = run_episodes(
        engine_for(calculator_model),
        tok,
        jobs,
        CalculatorEnv(tok),
        SamplingParams(temperature=0),
        Budget(max_context=128, max_turn_tokens=16, max_turns=3),
        seed=1,
        policy_version=7,
    )
    for t, tr in zip(tasks, trajs):
        assert (tr.task_id, tr.domain, tr.policy_version, tr.status, tr.reward) == (t.task_id, "arith", 7, "ok", 1.0)
        teacher_ids, teacher_mask = tok.encode_chat(teacher_messages(t, "calculator"))
        assert tr.token_ids.tolist() == teacher_ids  # learned by heart: the rollout is the demonstration
        assert tr.loss_mask.tolist() == teacher_mask
        assert len(tr.turn_boundaries) == 2 and tr.prompt_len == tr.turn_boundaries[0][0]
        assert np.all(tr.rollout_logprobs[tr.loss_mask == 0] == 0)
        assert np.all(tr.rollout_logprobs == 0)  # greedy: every sampled token had probability 1


def test_failures_are_labelled_by_cause(world, calculator_model):
    arith, closure, tok = world
    engine = engine_for(calculator_model)
    greedy = SamplingParams(temperature=0)
    budget = Budget(max_context=128, max_turn_tokens=16, max_turns=3)
    run = lambda tasks, env=None, budget=budget, **kw: run_episodes(  # noqa: E731
        engine,
        tok,
        [EpisodeJob(t, i, 0) for i, t in enumerate(tasks)],
        env or CalculatorEnv(tok),
        greedy,
        budget,
        seed=0,
        policy_version=0,
        **kw,
    )

    # the verifier itself fails (unknown verifier): infrastructure, not the model
    broken_task = dataclasses.replace(arith[0], verifier="no-such-verifier")
    assert run([broken_task])[0].status == "infra_error"

    class crashing_env_test_double(CalculatorEnv):  # an environment with a bug
        def step(self, task, state, turn_ids):
            raise KeyError("bug")

    assert run(arith[:2], env=crashing_env_test_double(tok))[0].status == "infra_error"
    # the engine fails (context past the model's positions): every live episode is infra_error
    too_long = Budget(max_context=10_000, max_turn_tokens=calculator_model.config.max_position_embeddings)
    assert {t.status for t in run(arith[:2], budget=too_long)} == {"infra_error"}
    # the model learned the call only: with a single turn it never answers -> truncated
    assert run(arith[:1], budget=Budget(128, 16, max_turns=1))[0].status == "truncated"
    # a tiny context ends the episode truncated, cut exactly at the budget
    tr = run(arith[:1], budget=Budget(max_context=12, max_turn_tokens=16))[0]
    assert tr.status == "truncated" and len(tr) == 12 and tr.reward == 0.0

    # an unparseable tool call is the model's failure
    class calc_without_closing_tag_test_double(CalculatorEnv):  # the model's call, with </tool_call> dropped
        def step(self, task, state, turn_ids):
            return super().step(task, state, [i for i in turn_ids if i != tok.tool_call_end_id])

    tr = run(arith[:1], env=calc_without_closing_tag_test_double(tok))[0]
    assert tr.status == "invalid_action" and tr.reward == 0.0 and len(tr.turn_boundaries) == 1


def assert_same_episodes(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert (x.task_id, x.attempt, x.status, x.reward, x.turn_boundaries) == (
            y.task_id,
            y.attempt,
            y.status,
            y.reward,
            y.turn_boundaries,
        )
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.loss_mask, y.loss_mask)
        np.testing.assert_allclose(x.rollout_logprobs, y.rollout_logprobs, atol=1e-4)


def test_episodes_are_deterministic_and_independent_of_the_batch(world):
    arith, closure, tok = world
    engine = engine_for(tiny_model(tok, seed=3))
    params = SamplingParams(temperature=1.0)
    budget = Budget(max_context=96, max_turn_tokens=6, max_turns=3)
    jobs = [EpisodeJob(t, group_id=g, attempt=a) for g, t in enumerate(arith[:2] + closure[:2]) for a in range(2)]
    env = CalculatorEnv(tok)
    everything = run_episodes(engine, tok, jobs, env, params, budget, seed=11, policy_version=0)
    again = run_episodes(engine, tok, jobs, env, params, budget, seed=11, policy_version=0)
    alone = run_episodes(engine, tok, jobs[5:6], env, params, budget, seed=11, policy_version=0)
    reordered = run_episodes(engine, tok, jobs[::-1], env, params, budget, seed=11, policy_version=0)
    other_seed = run_episodes(engine, tok, jobs, env, params, budget, seed=12, policy_version=0)
    assert everything == again
    # batched kernels may move logprobs in the last bits; the sampled tokens must not move
    assert_same_episodes(alone, everything[5:6])
    assert_same_episodes(reordered[::-1], everything)
    assert [t.token_ids.tolist() for t in other_seed] != [t.token_ids.tolist() for t in everything]
    for tr in everything:
        model_tokens = np.zeros(len(tr), bool)
        for s, e in tr.turn_boundaries:
            model_tokens[s:e] = True
        assert np.array_equal(tr.loss_mask.astype(bool), model_tokens)
        assert np.all(tr.rollout_logprobs[tr.loss_mask == 1] <= 0)
