"""Weight handoff: published versions load exactly; torn, unstable, corrupt or altered versions never load."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import IO, sha256_bytes, verify_manifest, write_manifest
from snowcat.stages.model import PRESETS, MoEForCausalLM, load_model_dir, save_model_dir, shards
from snowcat.stages.model.io import INDEX, hf_state_dict
from snowcat.stages.rlcore.handoff import STABLE, HandoffError, WeightHandoff, version_for_batch
from tests.conftest import mpirun

REPO = Path(__file__).resolve().parent.parent


def _model(seed: int) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(PRESETS["test-micro"])


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_version_for_batch_is_exact_staleness():
    assert [version_for_batch(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [version_for_batch(k, 0) for k in range(3)] == [0, 1, 2]


def test_publish_then_load_gives_the_published_weights(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    src, dst = _model(1), _model(2)
    assert not _same(src, dst)
    path = h.publish(3, src)
    assert (path / STABLE).is_file() and h.is_stable(3) and h.versions() == [3]
    h.load_into(dst, 3, timeout_s=1)
    assert _same(src, dst)


def test_unpublished_version_times_out_with_a_clear_error(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    with pytest.raises(HandoffError, match=r"weights step 4 not loadable after .*not published"):
        h.load_into(_model(0), 4, timeout_s=0.2)


def test_version_without_stable_marker_is_never_loaded(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(1, _model(1))
    (h.path(1) / STABLE).unlink()  # as if the publisher died after the rename, before STABLE
    dst = _model(2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(HandoffError, match="no STABLE marker"):
        h.load_into(dst, 1, timeout_s=0.2)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    h.clean(keep_upto=10)
    assert h.versions() == []  # the trainer's start-up repair drops it (and then republishes)


def test_corrupted_shard_is_never_loaded(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(2, _model(1))
    shard = h.path(2) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(HandoffError, match=r"model.safetensors: crc32 of bytes \d+-\d+ differs from manifest"):
        h.load_into(_model(2), 2, timeout_s=0.2)


def test_stopping_while_waiting_is_an_error_not_a_hang(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    with pytest.raises(HandoffError, match="stopped while waiting"):
        h.wait_verified(0, timeout_s=60, should_stop=lambda: True)


def test_prune_and_clean(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    m = _model(0)
    for v in range(4):
        h.publish(v, m)
    assert h.prune(below=2) == [0, 1] and h.versions() == [2, 3]
    h.clean(keep_upto=2)  # a trainer resumed at step 2 drops the future it will republish
    assert h.versions() == [2]


_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    import snowcat.stages.rlcore.handoff as handoff
    from snowcat.stages.model import PRESETS, MoEForCausalLM
    where, root = sys.argv[1], sys.argv[2]
    real_write = handoff.atomic_write_text

    def pause(*_, **__):  # the shards and configs are written inside the temp dir, the manifest not yet
        print("PAUSED", flush=True)
        time.sleep(600)

    def write(path, text):  # pause after the rename, before STABLE
        pause() if path.name == "STABLE" else real_write(path, text)

    if where == "building":
        handoff.write_manifest = pause  # handoff calls the name it imported
    else:
        handoff.atomic_write_text = write
    torch.manual_seed(0)
    handoff.WeightHandoff(root).publish(5, MoEForCausalLM(PRESETS["test-micro"]))
""")


@pytest.mark.parametrize("where", ["building", "before_stable"])
def test_publisher_killed_mid_publish_leaves_nothing_loadable(tmp_path, where):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    root = tmp_path / "weights"
    proc = subprocess.Popen(
        [sys.executable, str(script), where, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline().strip() == "PAUSED"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    h = WeightHandoff(root)
    assert not h.is_stable(5)
    with pytest.raises(HandoffError):
        h.load_into(_model(1), 5, timeout_s=0.2)
    h.clean(keep_upto=5)
    assert list(root.iterdir()) == []  # temp dir / unstable version gone
    src, dst = _model(0), _model(1)
    h.publish(5, src)  # the resumed trainer republishes; now it loads
    h.load_into(dst, 5, timeout_s=1)
    assert _same(src, dst)


# -- one pass: hashed as written, read straight into the model and hashed as read ---------------


@pytest.fixture
def sharded(monkeypatch):
    """Shards of ~64 KiB, so the test-micro model is published as several files (and the index)."""
    monkeypatch.setattr(shards, "SHARD_BYTES", 64 << 10)


def test_manifest_checked_while_writing_matches_the_files_on_disk(tmp_path, sharded):
    h = WeightHandoff(tmp_path / "weights")
    src = _model(1)
    before = dict(IO)
    path = h.publish(0, src)
    assert IO["files_hashed"] == before.get("files_hashed", 0)  # the publisher read nothing back to check it
    names = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(names) > 2 and (path / INDEX).is_file()
    assert verify_manifest(path, exclude=(STABLE,)) == []  # every entry equals a fresh checksum of the file
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    # the shards: a CRC-32 per chunk, each that of the file's bytes; the small files keep SHA-256
    for name in names:
        data, entry = (path / name).read_bytes(), manifest[name]
        chunk = entry["crc32_chunk"]
        assert entry == {
            "crc32": [zlib.crc32(data[i : i + chunk]) for i in range(0, len(data), chunk)],
            "crc32_chunk": chunk,
            "size": len(data),
        }
    assert all(
        manifest[n] == {"sha256": sha256_bytes((path / n).read_bytes()), "size": (path / n).stat().st_size}
        for n in (INDEX, "model_config.json")
    )
    # ordinary safetensors: the library reads them, and they hold the model's HF-named tensors
    expected = hf_state_dict(src)
    found = {}
    for name in names:
        with safe_open(str(path / name), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    assert found.keys() == expected.keys() and all(torch.equal(found[k], expected[k]) for k in found)


def test_sharded_version_loads_exactly(tmp_path, sharded):
    h = WeightHandoff(tmp_path / "weights")
    src, dst = _model(1), _model(2)
    h.publish(4, src)
    h.load_into(dst, 4, timeout_s=1)
    assert _same(src, dst)
    assert h.wait_verified(4, timeout_s=1) == h.path(4)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["tensor data", "header"])
def test_a_shard_altered_after_publish_is_refused(tmp_path, sharded, where):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(2, _model(1))
    shard = sorted(h.path(2).glob("*.safetensors"))[1]
    size = shard.stat().st_size
    _flip(shard, size - 3 if where == "tensor data" else 20)  # same size: only the hash can tell
    assert shard.stat().st_size == size
    with pytest.raises(HandoffError, match=f"{shard.name}: crc32 of bytes 0-{size} differs from manifest"):
        h.load_into(_model(2), 2, timeout_s=0.2)
    with pytest.raises(HandoffError, match=f"{shard.name}: crc32 of bytes 0-{size} differs from manifest"):
        h.wait_verified(2, timeout_s=0.2)  # what a reader that loads the files itself (vLLM) checks


@pytest.mark.parametrize("damage", ["config altered", "shard truncated", "header unparsable"])
def test_damage_found_before_reading_tensors_leaves_the_model_as_it_was(tmp_path, sharded, damage):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(1, _model(1))
    path = h.path(1)
    shard = sorted(path.glob("*.safetensors"))[0]
    if damage == "config altered":
        _flip(path / "model_config.json", 5)
    elif damage == "shard truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        _flip(shard, 8)  # the header's opening brace: the JSON no longer parses
    dst = _model(2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    named = "model_config.json" if damage == "config altered" else shard.name
    with pytest.raises(HandoffError, match=f"{named}: .*torn or corrupt version"):
        h.load_into(dst, 1, timeout_s=0.2)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    with pytest.raises(HandoffError, match=f"{named}: .*torn or corrupt version"):
        h.wait_verified(1, timeout_s=0.2)


def test_a_damaged_manifest_is_refused_not_a_crash(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(3, _model(1))
    manifest = h.path(3) / "manifest.json"
    entries = json.loads(manifest.read_text())
    entries["files"]["model.safetensors"]["crc32"][-1] ^= 1
    manifest.write_text(json.dumps(entries))
    with pytest.raises(HandoffError, match="model.safetensors: crc32 of bytes 0-.* differs from manifest"):
        h.load_into(_model(2), 3, timeout_s=0.2)
    for damage in ({"crc32_chunk": 0}, {"crc32_chunk": None}, {"size": "12"}):
        manifest.write_text(
            json.dumps({"files": entries["files"] | {"model.safetensors": entries["files"]["model.safetensors"] | damage}})
        )
        with pytest.raises(HandoffError, match="manifest.json damaged"):
            h.load_into(_model(2), 3, timeout_s=0.2)
    manifest.write_text("{not json")
    with pytest.raises(HandoffError, match="manifest.json damaged"):
        h.load_into(_model(2), 3, timeout_s=0.2)


def test_a_bf16_model_loads_through_a_conversion(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    src, dst = _model(1), _model(2).to(torch.bfloat16)
    h.publish(0, src)
    h.load_into(dst, 0, timeout_s=1)
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_a_version_written_by_the_safetensors_library_loads(tmp_path):
    """A version of another layout (safetensors' own writer, its own tensor order)."""
    h = WeightHandoff(tmp_path / "weights")
    src, dst = _model(1), _model(2)
    save_model_dir(h.path(6), src, meta={"policy_version": 6})
    save_file(hf_state_dict(src), str(h.path(6) / "model.safetensors"), metadata={"format": "pt"})
    write_manifest(h.path(6))
    (h.path(6) / STABLE).write_text("6\n")
    h.load_into(dst, 6, timeout_s=1)
    assert _same(src, dst)


def test_a_version_of_another_model_is_refused_by_name_and_leaves_the_model_alone(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(0, _model(1))
    other = MoEForCausalLM(dataclasses.replace(PRESETS["test-micro"], num_experts=PRESETS["test-micro"].num_experts * 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(UserError, match="experts"):
        h.load_into(other, 0, timeout_s=0.2)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_manifest_takes_the_writers_hashes_only_for_files_of_that_size(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"defg")
    given = {"a": {"sha256": "given", "size": 3}}
    assert write_manifest(tmp_path, hashed=given) == {
        "a": {"sha256": "given", "size": 3},
        "b": {"sha256": sha256_bytes(b"defg"), "size": 4},  # not given: hashed here
    }
    with pytest.raises(OSError, match="2 bytes on disk, 3 written"):
        (tmp_path / "a").write_bytes(b"ab")
        write_manifest(tmp_path, hashed=given)
    with pytest.raises(OSError, match="c: written, but not there"):
        write_manifest(tmp_path, hashed={"c": {"sha256": "x", "size": 1}})


def test_a_version_carries_the_tokenizer_and_loads_as_a_model_directory_by_itself(tmp_path):
    """With the trainer's tokenizer, a version carries its tokenizer files and chat template
    (beside config.json where the model has a Hugging Face form), which transformers opens without
    snowcat; they are in the manifest, so an altered one is refused like an altered shard."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (this test only)

    from snowcat.stages.model.tiny_hf import hf_chat_tokenizer  # noqa: PLC0415

    tok = hf_chat_tokenizer(["def f(x):\n    return x + 1\n", "print('hello world')"], tmp_path / "tok")
    h = WeightHandoff(tmp_path / "weights")
    path = h.publish(2, _model(1), tok)
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest)
    served = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    chat = [{"role": "user", "content": "print('hello')"}]
    assert served.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) == tok.render_prompt(
        chat
    )
    h.verify(2)

    (path / "tokenizer.json").write_text((path / "tokenizer.json").read_text().replace("hello", "jello"))
    with pytest.raises(HandoffError, match="tokenizer.json: (sha256 differs|size)"):
        h.wait_verified(2, timeout_s=0.2)


_VERIFIED_BY_LEAD = textwrap.dedent("""
    import json, sys, types
    from pathlib import Path
    from mpi4py import MPI
    from snowcat.stages.rlcore.handoff import HandoffError, WeightHandoff
    from snowcat.stages.rlcore.trainer import Trainer

    comm = MPI.COMM_WORLD
    handoff = WeightHandoff(sys.argv[1])
    if comm.Get_rank() != 0:  # only rank 0 reads the files to hash them
        handoff.verify = lambda step: (_ for _ in ()).throw(AssertionError("rank 1 hashed the version"))
    me = types.SimpleNamespace(lead=comm.Get_rank() == 0, handoff=handoff, group=comm,
                               cfg=types.SimpleNamespace(timeout_s=0.3))
    said = {"verified": str(Trainer._verified_by_lead(me, 1))}
    try:
        Trainer._verified_by_lead(me, 2)
    except HandoffError as e:
        said["refused"] = str(e)
    Path(sys.argv[2], f"{comm.Get_rank()}.json").write_text(json.dumps(said))
""")


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("mpirun"), reason="needs OpenMPI's mpirun")
def test_trainer_ranks_take_rank_0s_verification(tmp_path):
    """Under fsdp each trainer rank reads its rows of a weight version; rank 0 alone hashes it and
    the others take its word, a good version's path or the refusal of a corrupt one (no rank hangs)."""
    h = WeightHandoff(tmp_path / "weights")
    h.publish(1, _model(1))
    h.publish(2, _model(2))
    shard = h.path(2) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "child.py").write_text(_VERIFIED_BY_LEAD)
    proc = mpirun(2, tmp_path / "child.py", h.root, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert said[0] == said[1], said
    assert said[0]["verified"] == str(h.path(1))
    assert "model.safetensors: crc32 of bytes" in said[0]["refused"]


# -- what a publish and a load cost: one fsync and one read per file ------------------------------


def _read_so_far() -> int:
    """Bytes this process (all its threads) has read through read calls (Linux's rchar)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="needs Linux's /proc/self/io")
def test_a_load_reads_each_file_once(tmp_path, sharded):
    """The small files, the manifest and every shard (header and tensors) are read once: the
    checksums are taken of the bytes as they land in the model, never of a second read."""
    h = WeightHandoff(tmp_path / "weights")
    src, dst = _model(1), _model(2)
    path = h.publish(1, src)
    h.load_into(dst, 1, timeout_s=1)  # a first load: whatever a lazy import reads is read now
    files = sum(p.stat().st_size for p in path.iterdir() if p.name != STABLE)
    dst = _model(2)
    before = _read_so_far()
    h.load_into(dst, 1, timeout_s=1)
    read = _read_so_far() - before
    assert _same(src, dst)
    assert files <= read <= files + 4096, f"{read} bytes read for {files} bytes of files"  # + the /proc read above


def test_a_publish_fsyncs_each_file_once(tmp_path, sharded, monkeypatch):
    """Each file (STABLE included) is fsynced by its writer, not again before the version's rename."""
    real, synced = os.fsync, Counter()

    def fsync(fd):
        if stat.S_ISREG((st := os.fstat(fd)).st_mode):
            synced[st.st_ino] += 1  # files are fsynced under temp names: the inode outlives the rename
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = WeightHandoff(tmp_path / "weights").publish(1, _model(1))
    assert synced == Counter(p.stat().st_ino for p in path.iterdir()), sorted(p.name for p in path.iterdir())


def test_a_stale_shard_of_the_same_size_is_refused(tmp_path, sharded):
    """Another version's shard where this one's should be (a stale copy, same size and header):
    every chunk's CRC differs; the reader names the file and the first bytes that differ."""
    h = WeightHandoff(tmp_path / "weights")
    h.publish(1, _model(1))
    h.publish(2, _model(2))
    shard = sorted(h.path(2).glob("*.safetensors"))[1]
    shutil.copyfile(h.path(1) / shard.name, shard)
    with pytest.raises(HandoffError, match=f"{shard.name}: crc32 of bytes 0-{shard.stat().st_size} differs from manifest"):
        h.load_into(_model(3), 2, timeout_s=0.2)
    with pytest.raises(HandoffError, match=f"{shard.name}: crc32 of bytes 0-"):
        h.wait_verified(2, timeout_s=0.2)


def test_a_chunk_past_the_first_is_named(tmp_path, monkeypatch):
    """A flip in the third CRC chunk of a shard is reported with that chunk's byte range."""
    monkeypatch.setattr(shards, "CRC32_CHUNK", 4096)  # a test-micro shard has dozens of chunks
    h = WeightHandoff(tmp_path / "weights")
    h.publish(1, _model(1))
    shard = h.path(1) / "model.safetensors"
    _flip(shard, 2 * 4096 + 5)
    with pytest.raises(HandoffError, match=f"{shard.name}: crc32 of bytes 8192-12288 differs from manifest"):
        h.load_into(_model(2), 1, timeout_s=0.2)


def test_a_version_loads_in_transformers_as_the_model_it_was_published_from(tmp_path):
    """A version of a model with a Hugging Face form is a checkpoint transformers loads by itself,
    computing what the model computes."""
    import transformers  # noqa: PLC0415 (this test only)

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    model, _, _ = load_model_dir(tmp_path / "hf")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)  # weights of its own, not the checkpoint's
    path = WeightHandoff(tmp_path / "weights").publish(0, model)
    served = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # transformers fuses the experts as it loads: compare what the weights compute
        torch.testing.assert_close(served(ids).logits, model.logits(model(ids).hidden), rtol=1e-5, atol=1e-5)
