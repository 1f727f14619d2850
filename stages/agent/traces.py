"""External agent traces as demonstrations: OpenAI-style chat messages with tool calls (the form
SWE-smith, SWE-Gym and most agent frameworks publish), rendered in the protocol RepoEnv speaks.

Input: JSONL with one `{"messages": [...], "tools": [...]}` per line (`tools` optional: the OpenAI
function schemas the trace's agent was offered), or a bare list of messages per line. Messages are
checked and normalised (content parts joined, each tool call's `arguments` parsed to an object);
a trace's tools open the conversation as a template declaration (`{"role": "template", "tools": ...}`,
stages.tokenizer.split_template), so a checkpoint's template lists them where it lists RepoEnv's;
the tokenizer then renders tool calls and results in its template's format (snowcat's:
`<tool_call>{json}</tool_call>`, `<tool_result>...</tool_result>`; a checkpoint's: its own), the
same format the agent loop parses, so SFT on imported traces teaches the agent loop's protocol.
"""

from __future__ import annotations

import json
from pathlib import Path

from snowcat.stages.tokenizer import TEMPLATE_ROLE

ROLES = ("system", "user", "assistant", "tool")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, line and message."""


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise TraceError(f"{where}: content must be a string or a list of parts")


def _call(call: dict, where: str) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise TraceError(f"{where}: a tool call needs function.name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: tool call arguments are not JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise TraceError(f"{where}: tool call arguments must be an object")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def convert_messages(messages: list, where: str) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        at = f"{where}: message {i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise TraceError(f"{at}: role must be one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _text(m.get("content"), at)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, at) for c in m["tool_calls"]]
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise TraceError(f"{where}: no assistant turn to learn from")
    return out


def convert_tools(tools, where: str) -> list[dict]:
    """OpenAI function schemas (`{"type": "function", "function": {"name", ...}}`, or the bare
    function object), each in the full form."""
    if not isinstance(tools, list):
        raise TraceError(f"{where}: tools must be a list of function schemas")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TraceError(f"{where}: tools[{i}] needs function.name")
        out.append({"type": "function", "function": fn})
    return out


def import_traces(path: str | Path) -> list[list[dict]]:
    """Every conversation in the JSONL file at `path`, converted."""
    path = Path(path)
    convs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{n}: not JSON: {e.msg}") from None
        messages = row.get("messages") if isinstance(row, dict) else row
        if not isinstance(messages, list):
            raise TraceError(f"{path}:{n}: expected {{'messages': [...]}} or a list of messages")
        conv = convert_messages(messages, f"{path}:{n}")
        if isinstance(row, dict) and row.get("tools"):
            conv.insert(0, {"role": TEMPLATE_ROLE, "tools": convert_tools(row["tools"], f"{path}:{n}")})
        convs.append(conv)
    return convs
