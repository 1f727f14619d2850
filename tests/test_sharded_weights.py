"""Weights that never sit whole on a rank: the streaming shard writer, row-range reads of a model
directory, and the fsdp backend (with and without experts sharded) loading only each rank's rows,
writing whole, byte-identical model directories one gathered weight at a time, and giving the RL
reference and behaviour weights as copies sharded the same way.

The distributed part runs a gloo pair beside a single process (test_zero3.one_and_two_ranks): the
single process writes the reference directories with the torch backend, the pair loads a model
directory under fsdp (+ EP=2) and writes it back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_save
from test_train import MICRO, toy_examples
from test_train_distributed import join_gloo
from test_zero3 import CFG, OPTIM, PARAMS, WEIGHT_ATOL, one_and_two_ranks, rl_batch
from torch.distributed.tensor import DTensor

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_dir, file_entry, read_json, sha256_file, verify_manifest, write_manifest
from snowcat.stages.model import MoEForCausalLM, load_model_dir, save_model_dir, shards
from snowcat.stages.model.io import WeightReader, copy_model_dir, hf_state_dict, stream_tensors
from snowcat.stages.model.shards import write_shards
from snowcat.stages.rlcore.objective import sampled_logprobs
from snowcat.stages.train import PackedLoader, load_for_training, make_backend, save_weights
from snowcat.stages.train.loss import sft_loss

SHARD = 20_000  # bytes: the test-micro model in several files, experts of one layer split across two


def _saved(path: Path, seed: int = 3, cfg=MICRO) -> Path:
    torch.manual_seed(seed)
    return save_model_dir(path, MoEForCausalLM(cfg), max_shard_bytes=SHARD)


def _weight_hashes(path: Path) -> dict[str, str]:
    """sha256 of the weight files (shards and index) as the manifest records them."""
    files = read_json(path / "manifest.json")["files"]
    return {name: e["sha256"] for name, e in files.items() if name.startswith("model")}


# ---------------------------------------------------------------- single process


def test_writer_holds_only_the_shards_in_flight(tmp_path):
    """64 tensors of 1 MiB in 2 MiB shards: the writer hands each full shard to a thread and waits
    once a shard per thread is in flight, so the traced memory (numpy-backed tensors) stays a few
    shards, never the stream's 64 MiB."""
    threads = len(os.sched_getaffinity(0))
    count = max(64, 8 * (threads + 2))

    def stream():
        for i in range(count):
            yield f"t{i:03d}", torch.from_numpy(np.full(1 << 18, i, dtype=np.float32))  # 1 MiB each

    tracemalloc.start()
    try:
        with atomic_dir(tmp_path / "m") as tmp:
            entries = write_shards(tmp, stream(), shard_bytes=2 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len([n for n in entries if n.endswith(".safetensors")]) == count // 2
    # a shard per thread in flight, one full and one filling, the stream's next tensor (1 MiB), and
    # 1 MiB for what else the process allocates meanwhile (CI saw 11.06 MiB against 11 without it)
    assert peak <= (threads + 2) * (2 << 20) + (4 << 20), f"peak {peak / 2**20:.1f} MiB held"
    with WeightReader(tmp_path / "m", MICRO) as weights:  # every tensor where the index says
        assert all(float(weights.rows(f"t{i:03d}", 0, 1)[0]) == i for i in range(count))


@pytest.mark.parametrize("tie", [False, True])
def test_row_ranges_are_the_rows_of_the_loaded_weights(tmp_path, tie):
    cfg = dataclasses.replace(MICRO, tie_word_embeddings=tie)
    path = _saved(tmp_path / "m", cfg=cfg)
    assert len(list(path.glob("*.safetensors"))) > 2
    model, _, _ = load_model_dir(path)
    whole = model.state_dict()
    with WeightReader(path, cfg) as weights:
        weights.check(whole)
        for name, t in whole.items():
            n = t.shape[0]
            for start, stop in ((0, n), (1, max(1, n - 1)), (n // 2, n), (n, n)):
                part = weights.rows(name, start, stop)
                assert part.shape == t[start:stop].shape and torch.equal(part, t[start:stop]), (name, start, stop)


@pytest.mark.parametrize("tie", [False, True])
def test_a_frozen_copy_holds_the_directory_s_weights(tmp_path, tie):
    """What the RL reference and behaviour weights are under a replicated backend: a tied head stays
    the embeddings (a copy that lost the tie sampled from uninitialised memory)."""
    cfg = dataclasses.replace(MICRO, tie_word_embeddings=tie)
    path = _saved(tmp_path / "m", cfg=cfg)
    model, _, _ = load_model_dir(path)
    frozen = make_backend("torch", model, OPTIM).frozen_copy(path)
    assert (frozen.lm_head.weight is frozen.model.embed_tokens.weight) == tie
    assert not any(p.requires_grad for p in frozen.parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(frozen.logits(frozen(ids).hidden), model.logits(model(ids).hidden))


def test_a_directory_of_another_model_is_refused_naming_it(tmp_path):
    path = _saved(tmp_path / "m")
    more = dataclasses.replace(MICRO, num_experts=MICRO.num_experts * 2)
    with WeightReader(path, more) as weights, pytest.raises(UserError, match=f"{path}: missing tensor .*experts"):
        weights.check(MoEForCausalLM(more).state_dict())
    fewer = dataclasses.replace(MICRO, num_layers=MICRO.num_layers - 1)
    with WeightReader(path, fewer) as weights, pytest.raises(UserError, match=f"{path}: unexpected tensor model.layers"):
        weights.check(MoEForCausalLM(fewer).state_dict())


def test_copy_writes_the_bytes_a_loaded_model_would(tmp_path):
    src = _saved(tmp_path / "src")
    model, _, _ = load_model_dir(src)
    save_model_dir(tmp_path / "from_model", model)
    copy_model_dir(src, tmp_path / "copied")
    assert _weight_hashes(tmp_path / "copied") == _weight_hashes(tmp_path / "from_model")
    assert (tmp_path / "copied" / "model_config.json").read_text() == (tmp_path / "from_model" / "model_config.json").read_text()


@pytest.mark.parametrize("check", ["sha256", "crc32"])
def test_a_shard_is_byte_for_byte_what_safetensors_writes(tmp_path, check):
    """Given the tensors in the order safetensors' own writer lays them out (its header lists
    them in that order), the writer's file is that library's, byte for byte, whichever checksum."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g),
        "a.weight": torch.randn(7, generator=g),
        "norm": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5),
        "mask": torch.ones(3, dtype=torch.bool),
        "expert": torch.randn(3, 2, generator=g).double().t(),  # not contiguous: written from a contiguous copy
    }
    want = safetensors_save({k: t.contiguous() for k, t in tensors.items()}, metadata={"format": "pt"})
    order = [k for k in json.loads(want[8 : 8 + int.from_bytes(want[:8], "little")]) if k != "__metadata__"]
    with atomic_dir(tmp_path / "m") as tmp:
        entries = write_shards(tmp, [(k, tensors[k]) for k in order], check=check)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == want
    assert entries["model.safetensors"] == file_entry(tmp_path / "m" / "model.safetensors", entries["model.safetensors"])
    assert ("crc32" in entries["model.safetensors"]) == (check == "crc32")


def test_crc32_entries_are_a_crc_per_chunk_and_model_directories_keep_sha256(tmp_path, monkeypatch):
    """The handoff's shards carry a CRC-32 of every chunk (the last one short); a model directory
    (a checkpoint, an export: provenance) keeps SHA-256 of every file."""
    monkeypatch.setattr(shards, "CRC32_CHUNK", 1000)
    model = MoEForCausalLM(MICRO)
    with atomic_dir(tmp_path / "m") as tmp:
        entries = write_shards(tmp, hf_state_dict(model).items(), shard_bytes=SHARD, check="crc32")
    assert len(entries) > 3
    for name, entry in entries.items():
        data = (tmp_path / "m" / name).read_bytes()
        if name.endswith(".safetensors"):
            assert entry == {
                "crc32": [zlib.crc32(data[i : i + 1000]) for i in range(0, len(data), 1000)],
                "crc32_chunk": 1000,
                "size": len(data),
            }
        else:  # the index
            assert entry == {"sha256": sha256_file(tmp_path / "m" / name), "size": len(data)}
    path = save_model_dir(tmp_path / "dir", model, max_shard_bytes=SHARD)
    files = read_json(path / "manifest.json")["files"]
    assert all(set(e) == {"sha256", "size"} and e["sha256"] == sha256_file(path / n) for n, e in files.items())
    # a manifest of CRC entries verifies as one of SHA-256 entries does (a version loaded as a model directory)
    write_manifest(tmp_path / "m", hashed=entries)
    assert verify_manifest(tmp_path / "m") == []
    shard = tmp_path / "m" / sorted(n for n in entries if n.endswith(".safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert verify_manifest(tmp_path / "m") == [f"{shard}: crc32 differs from manifest"]


# ---------------------------------------------------------------- 1 process beside 2 gloo ranks


def _work(rank, world, port, tmp, _tasks, one_saved, two_saved) -> dict:
    join_gloo(rank, world, port)
    src = tmp / "src"
    out: dict = {}
    if world == 1:  # the references: a replicated backend's directories of the same weights
        backend, _ = load_for_training(src, "torch", OPTIM, device="cpu")
        out["frozen_logprobs"] = _frozen_logprobs(backend, src, [0, 1, 2, 3])
        save_weights(tmp / "torch_copy", backend)
        _train_step(backend, rank, world)
        save_weights(tmp / "torch_trained", backend, max_shard_bytes=SHARD)
        backend.save_state(tmp / "torch_state")
        return out
    rows = WeightReader.rows
    for name, ep in (("fsdp", 1), ("fsdp_ep", 2)):
        reads: list = []

        def recorded(self, param, start, stop, reads=reads):
            reads.append((param, start, stop))
            return rows(self, param, start, stop)

        WeightReader.rows = recorded
        try:
            backend, _ = load_for_training(src, "fsdp", OPTIM, device="cpu", expert_parallel=ep)
        finally:
            WeightReader.rows = rows
        held = {n: p.to_local().numel() if isinstance(p, DTensor) else p.numel() for n, p in backend.model.named_parameters()}
        out[name] = {"reads": reads, "held": held, "frozen_logprobs": _frozen_logprobs(backend, src, [2 * rank, 2 * rank + 1])}
        out[name]["frozen_sharded"] = all(
            isinstance(p, DTensor) for p in backend.frozen_copy().model.layers[0].self_attn.parameters()
        )
        save_weights(tmp / f"{name}_copy", backend)
        _train_step(backend, rank, world)
        save_weights(tmp / f"{name}_trained", backend, max_shard_bytes=SHARD)
        backend.save_state(tmp / f"{name}_state")  # every moment whole, gathered one at a time
        own = _local_state(backend)
        for state in backend.optimizer.state.values():  # forget the moments, then read them back
            for v in state.values():
                if v.dim():
                    v.zero_()
        dist.barrier()  # rank 0 has written the state
        backend.load_state(tmp / f"{name}_state")  # each rank reads its rows
        out[name]["state_round_trip"] = _local_state(backend) == own
    return out


def _local_state(backend) -> dict:
    """This rank's optimizer state, tensors as (shape, bytes) of what the rank holds."""

    def held(v):
        v = v.to_local() if isinstance(v, DTensor) else v
        return (tuple(v.shape), v.detach().cpu().contiguous().numpy().tobytes()) if torch.is_tensor(v) else v

    return {i: {k: held(v) for k, v in state.items()} for i, state in backend.optimizer.state_dict()["state"].items()}


def _frozen_logprobs(backend, src: Path, rows: list[int]) -> torch.Tensor:
    """Sampled logprobs of an RL batch's `rows` under the backend's frozen copy of `src` (the RL
    reference and behaviour weights: sharded as the trained model under fsdp, every rank in step)."""
    frozen = backend.frozen_copy(src)
    assert not any(p.requires_grad for p in frozen.parameters())
    with torch.no_grad():
        return sampled_logprobs(frozen, rl_batch(rows), PARAMS)[0]


def _train_step(backend, rank, world) -> None:
    """One SFT step on the same global batch whatever the number of ranks."""
    loader = PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=0, rank=rank, world_size=world, micro_batches=2)
    backend.train_step(loader.next(), sft_loss)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_reads_only_its_rows_and_writes_whole_directories_byte_identical(tmp_path):
    _saved(tmp_path / "src", cfg=CFG)  # router losses off: 1 and 2 ranks group rows into other micro-batches
    results = one_and_two_ranks(_work, tmp_path, tmp_path)
    whole = {n: t.shape for n, t in MoEForCausalLM(CFG).state_dict().items()}

    for name in ("fsdp", "fsdp_ep"):
        # a freshly loaded model written back: the source's weights exactly, in the bytes the
        # torch backend writes for them
        assert _weight_hashes(tmp_path / f"{name}_copy") == _weight_hashes(tmp_path / "torch_copy")
        # each rank read only its rows: the two ranks' reads of a weight are disjoint and cover it
        reads = [results[(2, r)][name]["reads"] for r in (0, 1)]
        for param, shape in whole.items():
            spans = sorted((start, stop) for log in reads for n, start, stop in log if n == param)
            assert spans[0][0] == 0 and spans[-1][1] == shape[0], (name, param, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, param, spans)
        held = [sum(results[(2, r)][name]["held"].values()) for r in (0, 1)]
        total = sum(int(np.prod(s)) for s in whole.values())
        assert max(held) < 0.6 * total  # about half each: no rank allocated the whole model
        # one update later, the pair's weights written whole equal the single process's (the
        # reduction order differs: equal within rounding, compared through the files)
        mine, ref = load_model_dir(tmp_path / f"{name}_trained")[0], load_model_dir(tmp_path / "torch_trained")[0]
        for n, t in hf_state_dict(ref).items():
            torch.testing.assert_close(hf_state_dict(mine)[n], t, rtol=1e-4, atol=WEIGHT_ATOL)
        # the frozen copy (RL reference / behaviour weights): sharded, and the whole model's logprobs
        assert results[(2, 0)][name]["frozen_sharded"]
        pair = torch.cat([results[(2, r)][name]["frozen_logprobs"] for r in (0, 1)])
        torch.testing.assert_close(pair, results[(1, 0)]["frozen_logprobs"], rtol=1e-5, atol=1e-6)
        # the trainer state: every moment whole under its parameter's name, as the single process
        # writes it (within rounding: one update of other summation orders), each rank's rows read back exactly
        ref_state, state = (tmp_path / "torch_state", tmp_path / f"{name}_state")
        ref_moments, moments = (dict(stream_tensors(d / "moments")) for d in (ref_state, state))
        assert moments.keys() == ref_moments.keys() and any(k.startswith("exp_avg_sq/") for k in moments)
        for k, t in ref_moments.items():
            torch.testing.assert_close(moments[k], t, rtol=1e-3, atol=1e-6)
        assert all(results[(2, r)][name]["state_round_trip"] for r in (0, 1))
