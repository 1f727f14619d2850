"""Small random Hugging Face checkpoints built locally, for tests, demos and `configs/hf-tiny.yaml`.

There is no hub on a test machine or an offline compute node, so `snowcat tiny-hf DIR` writes what a
hub download looks like: `config.json` + safetensors from `transformers` (`<Arch>ForCausalLM(config)
.save_pretrained`), and a byte-level BPE tokenizer (`tokenizers`) in `PreTrainedTokenizerFast` with a
ChatML chat template that renders tool calls and results as Qwen3's does (`<tool_call>` JSON blocks,
`<tool_response>`). head_dim is 32: vLLM's CPU attention rejects 16. 2 attention heads sharing 1
key/value head by default; `--kv-heads 2` (with `--heads`, a multiple of it) gives attention that
Megatron can split over 2 tensor-parallel ranks (TP must divide both, stages/model/layout.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import PreTrainedTokenizerFast

from snowcat.stages.hf_tokenizer import HFChatTokenizer
from snowcat.stages.tokenizer import train_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}
{%- for call in m.tool_calls | default([]) %}
<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def hf_tokenizer_files(texts: list[str], out_dir, vocab_size: int = 400) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja in `out_dir`."""
    tok = train_bpe(list(texts) * 2, vocab_size, SPECIALS, min_frequency=0)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:2] + SPECIALS[3:],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))


def hf_chat_tokenizer(texts: list[str], out_dir, vocab_size: int = 400) -> HFChatTokenizer:
    hf_tokenizer_files(texts, out_dir, vocab_size)
    return HFChatTokenizer.load(out_dir)


def tiny_checkpoint(
    out_dir,
    texts: list[str],
    arch: str = "qwen3_moe",
    seed: int = 0,
    vocab_size: int = 300,
    positions: int = 512,
    dtype: str = "float32",
    heads: int = 2,
    kv_heads: int = 1,
):
    """A random Hugging Face checkpoint (weights, config.json) with the tokenizer above: what a
    hub download looks like, small enough for a test. head_dim 32 (vLLM's CPU floor). `dtype`:
    what the weights are stored in (bfloat16: as nearly every checkpoint on the hub). `heads`
    attention heads in groups over `kv_heads` key/value heads (a tensor-parallel degree must divide
    both; OLMoE's head_dim is hidden / heads, so its hidden size grows with the heads)."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    hf_tokenizer_files(texts, out_dir, vocab_size=vocab_size)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    common = dict(
        vocab_size=len(tok),
        hidden_size=64 if arch != "olmoe" else 32 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        ),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32, intermediate_size=96),
        "olmoe": lambda: transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    }
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs[arch]()).to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return model.eval()


ARCHES = ("qwen3_moe", "qwen3", "olmoe")


def corpus(kind: str, rng) -> list[str]:
    """What the tokenizer is trained on. `arith`: closure and arithmetic prompts with their worked
    answers (configs/hf-tiny.yaml). `swe_mini`: repository tasks and the scripted expert's RepoEnv
    episodes (tool calls, file views, test output), so that an agent episode fits a small context."""
    from snowcat.stages.taskgen import demonstration, generate_domain  # noqa: PLC0415 (only the command needs tasks)

    if kind == "arith":
        tasks = generate_domain(rng, "closure", [1, 2, 3], 200) + generate_domain(rng, "arith", [2, 3], 200)
        return [t.prompt for t in tasks] + [demonstration(t) for t in tasks] + ["That is not right. Try again."]
    from snowcat.stages.agent import teacher_messages  # noqa: PLC0415
    from snowcat.stages.tokenizer import message_text  # noqa: PLC0415

    tasks = generate_domain(rng, "swe_mini", [1, 2, 3], 24)
    return [t.prompt for t in tasks] + [message_text(m) for t in tasks for m in teacher_messages(t, "repo")]


CORPORA = {"arith": (300, 512), "swe_mini": (2048, 4096)}  # corpus -> (vocabulary, positions)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat tiny-hf", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write (created)")
    ap.add_argument("--arch", choices=ARCHES, default="qwen3_moe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", choices=sorted(CORPORA), default="arith", help="what the tokenizer is trained on (see corpus())")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="what the weights are stored in")
    ap.add_argument("--heads", type=int, default=2, help="attention heads (a multiple of --kv-heads)")
    ap.add_argument(
        "--kv-heads", type=int, default=1, help="key/value heads; a Megatron tensor_parallel degree must divide it (2: TP2)"
    )
    args = ap.parse_args(argv)
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    vocab, positions = CORPORA[args.corpus]
    texts = corpus(args.corpus, np.random.default_rng(args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_checkpoint(args.out, texts, args.arch, args.seed, vocab, positions, args.dtype, args.heads, args.kv_heads)
    heads = "" if (args.heads, args.kv_heads) == (2, 1) else f", {args.heads} heads, {args.kv_heads} KV heads"
    (args.out / "README.md").write_text(
        f"---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n"
        f"# tiny random {args.arch} (snowcat tiny-hf, seed {args.seed}, {args.corpus} tokenizer{heads})\n"
    )
    print(
        f"{args.out}: random {args.arch}, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{args.heads} attention heads over {args.kv_heads} KV heads, {args.corpus} tokenizer"
    )
    return 0
