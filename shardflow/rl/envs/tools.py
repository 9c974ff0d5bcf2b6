"""Tool use as an environment: the model's turn is parsed for tool calls in its chat format, each
call runs a Python function, and the results are the next turn's observation (one message per
call, in ``rollout.observation_role``). A turn without a tool call is the episode's answer.

Formats (``TOOL_FORMATS``): ``hermes``, the Hermes / Qwen format, where a call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and the chat template renders the tool
list. Tools: the built-in ``calculator`` and ``python`` or a user's ``module:function``; a
function's schema for the template comes from its signature and the ``Args:`` of its docstring
(or its ``schema`` attribute).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from shardflow.rl.envs.calculator import calculator
from shardflow.rl.envs.python_sandbox import python
from shardflow.rl.user_code import load_object

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
MAX_RESULT_CHARS = 4096  # a tool's answer longer than this is cut (the model reads it as tokens)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str = ""  # a call that could not be read


def parse_hermes(text: str) -> list[ToolCall]:
    """The ``<tool_call>{json}</tool_call>`` blocks of a turn, in order."""
    calls = []
    for block in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL):
        try:
            value = json.loads(block.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON: {e.msg}"))
            continue
        name, arguments = (value.get("name"), value.get("arguments", {})) if isinstance(value, dict) else (None, None)
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        calls.append(ToolCall(name, arguments))
    return calls


TOOL_FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def load_tools(specs: list[str]) -> dict[str, Callable[..., Any]]:
    """Tool name -> function, from built-in names and ``module:function`` specs."""
    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        if not isinstance(spec, str):
            raise ValueError(f"rollout.tools entries must be text, got {spec!r}")
        if spec in BUILTIN_TOOLS:
            fn = BUILTIN_TOOLS[spec]
        elif ":" in spec:
            fn = load_object(spec, "tool")
            if not callable(fn):
                raise ValueError(f"tool {spec!r} is a {type(fn).__name__}, not a function")
        else:
            raise ValueError(f"tool {spec!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor "
                             "'module:function'")
        name = fn.__name__
        if name in tools:
            raise ValueError(f"two tools are named {name!r}")
        tools[name] = fn
    return tools


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema chat templates render for a tool (``fn.schema`` if it has one)."""
    if hasattr(fn, "schema"):
        return fn.schema
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].strip()
    described = dict(re.findall(r"^\s+(\w+):\s*(.+)$", doc.split("Args:", 1)[1], flags=re.M)) if "Args:" in doc else {}
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            continue  # keyword-only parameters are the tool's own settings, not the model's
        annotation = p.annotation if not isinstance(p.annotation, str) else {"str": str, "int": int, "float": float,
                                                                              "bool": bool}.get(p.annotation, str)
        prop = {"type": _JSON_TYPES.get(annotation, "string")}
        if name in described:
            prop["description"] = described[name]
        properties[name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": summary,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


class ToolEnv:
    """The built-in environment of ``rollout.env: tools``: one turn of tool calls after another
    until the model answers without one."""

    def __init__(self, row: dict, *, tools: list[str], tool_format: str = "hermes", role: str = "tool"):
        self.row, self.role = row, role
        self.tools = load_tools(tools)
        self.parse = TOOL_FORMATS[tool_format]

    def step(self, text: str) -> tuple[list[dict[str, str]] | None, float, bool, dict[str, int]]:
        calls = self.parse(text)
        if not calls:
            return None, 0.0, True, {"tool_calls": 0, "tool_errors": 0}
        messages, errors = [], 0
        for call in calls:
            result = self._run(call)
            errors += result.startswith("error:")
            messages.append({"role": self.role, "content": result})
        return messages, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors}

    def _run(self, call: ToolCall) -> str:
        if call.error:
            return f"error: {call.error}"
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})"
        try:
            result = fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model made a bad call: it reads why
            return f"error: {type(e).__name__}: {e}"[:MAX_RESULT_CHARS]
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " [cut]"
