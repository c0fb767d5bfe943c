"""A chat record's turns as chat templates read them: the one answer for training data and for `serve`.

The shape is OpenAI's chat format, as TRL's SFT datasets and transformers' `apply_chat_template` take it:

- a record `{"messages": [...], "tools": [...]}`: `tools` (optional) are OpenAI tool objects
  (`{"type": "function", "function": {"name", "description"?, "parameters"?}}`), passed to the template
  as transformers' `tools=` (the family's template writes them into the prompt);
- each turn `{"role", "content"}`; an assistant turn may carry `tool_calls`
  (`[{"type": "function", "id"?, "function": {"name", "arguments"}}]`, its `content` then may be null or
  absent), a `tool` turn `tool_call_id` and `name` (the function that answered).

A call's `arguments` reach the template as a dict: templates write them with `tojson` (Qwen2.5's, Llama
3's), so OpenAI's JSON text is parsed first (`call_arguments`, also what `serve` does with a history's
calls). Any other key of a turn is refused by name, never dropped (a template would not see it, so the
model would not learn it). Errors are ValueError with the field at fault (the reader adds file:line).
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
TURN_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}


def call_arguments(name: str, arguments: Any) -> dict[str, Any]:
    """A call's arguments as a dict: OpenAI's JSON text of an object parsed, a dict as is. ValueError
    for anything else (text that is not a JSON object, a list, a number)."""
    args = arguments
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            args = None
    if not isinstance(args, dict):
        shown = arguments[:80] if isinstance(arguments, str) else type(arguments).__name__
        raise ValueError(f"tool call {name}: arguments must be a JSON object's text, got {shown!r}")
    return args


def tool_calls_of(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's `tool_calls` in transformers' shape (`function.arguments` a dict)."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}.tool_calls must be a non-empty list of calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f'{at} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}')
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type {call['type']!r}: only function calls are supported")
        extra = sorted(set(call) - {"type", "id", "function"}) + sorted(set(fn) - {"name", "arguments"})
        if extra:
            raise ValueError(f"{at}: {', '.join(extra)} not supported (a call has type, id, function.name, "
                             "function.arguments)")
        item: dict[str, Any] = {"type": "function", "function": {
            "name": fn["name"], "arguments": call_arguments(fn["name"], fn.get("arguments", {}))}}
        if call.get("id") is not None:
            item["id"] = str(call["id"])
        out.append(item)
    return out


def turn_of(m: Any, i: int) -> dict[str, Any]:
    """messages[i] as templates read it. ValueError naming the field at fault."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where} must be an object with string role and content")
    role = m["role"]
    if role not in ROLES:
        raise ValueError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
    unknown = sorted(set(m) - TURN_KEYS)
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} not supported (a turn has role, content, and tool_calls "
                         "on an assistant turn, tool_call_id and name on a tool turn)")
    calls = m.get("tool_calls")
    content = m.get("content")
    if not (isinstance(content, str) or (content is None and calls and role == "assistant")):
        raise ValueError(f"{where} must be an object with string role and content")
    turn: dict[str, Any] = {"role": role, "content": content or ""}
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{where}.tool_calls: only an assistant turn makes calls, not a {role} turn")
        turn["tool_calls"] = tool_calls_of(calls, where)
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if role != "tool":
                raise ValueError(f"{where}.{key}: only a tool turn has one, not a {role} turn")
            if not isinstance(m[key], str):
                raise ValueError(f"{where}.{key} must be a string")
            turn[key] = m[key]
    return turn


def tools_of(tools: Any) -> list[dict[str, Any]] | None:
    """A record's `tools`, checked (each an OpenAI function tool with a name); None when absent or empty. A
    JSON text of the list is read as the list: Hub datasets stored as Parquet keep `tools` as a string (Arrow
    has no type for schemas that differ per row), as TRL's and prime-rl's SFT loaders read it (prime-rl #885)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise ValueError('field "tools" is text but not JSON: give a list of tool objects') from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ValueError('field "tools" must be a list of {"type": "function", "function": {"name": ...}}')
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]
                or tool.get("type", "function") != "function"):
            raise ValueError(f'tools[{j}] must be {{"type": "function", "function": {{"name": ..., '
                             '"description": ..., "parameters": {...}}}}}')
    return tools


def names_in(turn: dict[str, Any]) -> list[str]:
    """What of a turn must reach the rendered text besides its content: its calls' function names."""
    return [c["function"]["name"] for c in turn.get("tool_calls", ())]
