"""Structural closure: a prefix of nested JSON whose closing delimiters the model must emit.

The seed model card's "structural closure" task: close the required syntax (JSON brackets,
tool-call delimiters) while preserving the required content. The prompt is a JSON document cut
just before its trailing run of closers; earlier siblings are complete containers, so a model must
track which brackets are still open rather than count brackets. Difficulty = open nesting depth.
"""

from __future__ import annotations

import json

import numpy as np

KEYS = "abcdefghijkmnpqrstuvwxyz"
CLOSER = {"{": "}", "[": "]"}


def _scalar(rng: np.random.Generator):
    return int(rng.integers(0, 100)) if rng.random() < 0.7 else KEYS[rng.integers(len(KEYS))] * 2


def _closed_container(rng: np.random.Generator, depth: int):
    """A small complete container (its brackets are closed inside the prefix: distractors)."""
    if depth == 0 or rng.random() < 0.5:
        return _scalar(rng)
    if rng.random() < 0.5:
        return [_closed_container(rng, depth - 1) for _ in range(rng.integers(1, 3))]
    keys = rng.choice(list(KEYS), size=rng.integers(1, 3), replace=False)
    return {str(k): _closed_container(rng, depth - 1) for k in keys}


def generate(rng: np.random.Generator, depth: int) -> tuple[str, str, dict]:
    """Return (prompt, answer, meta) for one task with `depth` unclosed containers."""
    # Build the open chain from the outside in: each level is a dict or list whose last element
    # is the next level; siblings before it are complete.
    kinds = ["{" if rng.random() < 0.5 else "[" for _ in range(depth)]
    parts: list[str] = []
    for level, kind in enumerate(kinds):
        siblings = [_closed_container(rng, 1) for _ in range(rng.integers(0, 3))]
        last_level = level == depth - 1
        if kind == "{":
            keys = list(rng.choice(list(KEYS), size=len(siblings) + 1, replace=False))
            items = [f"{json.dumps(str(k))}: {json.dumps(v, separators=(', ', ': '))}" for k, v in zip(keys, siblings)]
            head = f"{json.dumps(str(keys[-1]))}: "
            if last_level:
                items.append(head + json.dumps(_scalar(rng)))
                parts.append("{" + ", ".join(items))
            else:
                parts.append("{" + "".join(i + ", " for i in items) + head)
        else:
            items = [json.dumps(v, separators=(", ", ": ")) for v in siblings]
            if last_level:
                items.append(json.dumps(_scalar(rng)))
                parts.append("[" + ", ".join(items))
            else:
                parts.append("[" + "".join(i + ", " for i in items))
    prompt = "".join(parts)
    answer = "".join(CLOSER[k] for k in reversed(kinds))
    json.loads(prompt + answer)  # the generator's own invariant: prompt + answer is valid JSON
    return prompt, answer, {"open": "".join(kinds)}


def verify(prompt: str, answer: str, completion: str) -> tuple[float, bool, str]:
    """Full credit iff prompt+completion parses to the same document as prompt+answer.

    Partial credit: the fraction of required closers emitted correctly before the first mistake,
    ending the text being the last step (so every closer right and then more text scores n/(n+1):
    below full credit, which probe, select and RL count as a pass). Reported as reward, never a pass."""
    text = completion.strip()
    expected = json.loads(prompt + answer)
    try:
        if json.loads(prompt + text) == expected:
            return 1.0, True, "closed"
    except json.JSONDecodeError:
        pass
    correct = 0
    for got, want in zip(text, answer):
        if got != want:
            break
        correct += 1
    if correct == len(answer):  # every closer right, then more than the document
        return correct / (len(answer) + 1), False, f"{correct}/{len(answer)} closers correct, then {text[correct:][:20]!r}"
    return correct / len(answer), False, f"{correct}/{len(answer)} closers correct"
