"""Goldens for the gateway's chat tool and template parameters (chat_params_test.go).

Run with SGLang 0.5.23's venv from this folder:
    nice ~/.cache/kvcentric/venv-sglang-0.5.23-*/bin/python gen_chat_params.py > chat_params.json

Each body goes through SGLang's real ChatCompletionRequest (pydantic validation, Tool and
Function model_dump, normalize_reasoning_inputs) and OpenAIServingChat._validate_request; the
tools the chat template gets and its extra kwargs follow _process_messages and
_apply_jinja_template (serving_chat.py, 0.5.23), quoted below line for line. Each accepted
body's prompt is rendered as _render_and_encode_chat_template renders it —
tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools,
**template_kwargs) — with the committed Qwen3 tokenizer (pkg/tokenizer/testdata/qwen3).
"""

import copy
import gzip
import json
import os
import shutil
import sys
import tempfile

# sglang_stub first: it stands in for the libraries the venv lacks before SGLang imports them.
from sglang_stub import Chat, ChatCompletionRequest, fake_serving  # isort: skip
from sglang.srt.entrypoints.openai import serving_chat  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import ToolChoice  # noqa: E402

U = [{"role": "user", "content": "What is the weather in Paris?"}]
P = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}
W = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": P}}
T = {
    "type": "function",
    "function": {"name": "get_time", "description": "Time now", "parameters": {"type": "object", "properties": {}}},
}

CASES = [
    ("plain", {"messages": U}),
    ("one tool", {"messages": U, "tools": [W]}),
    ("two tools auto", {"messages": U, "tools": [W, T], "tool_choice": "auto"}),
    (
        "function keys reordered",
        {
            "messages": U,
            "tools": [
                {
                    "function": {"parameters": {"z": 1, "a": {"y": True, "b": None}}, "name": "f", "description": "d"},
                    "type": "function",
                }
            ],
        },
    ),
    ("no description", {"messages": U, "tools": [{"type": "function", "function": {"name": "f", "parameters": P}}]}),
    ("no parameters", {"messages": U, "tools": [{"type": "function", "function": {"description": "d", "name": "f"}}]}),
    ("name only", {"messages": U, "tools": [{"function": {"name": "f"}}]}),
    (
        "strict true",
        {"messages": U, "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": P}}]},
    ),
    ("strict null", {"messages": U, "tools": [{"type": "function", "function": {"strict": None, "name": "f"}}]}),
    (
        "function defer_loading",
        {"messages": U, "tools": [{"type": "function", "function": {"name": "f", "defer_loading": False}}]},
    ),
    (
        "tool defer_loading",
        {
            "messages": U,
            "tools": [{"type": "function", "defer_loading": True, "function": {"name": "f", "description": "d"}}],
        },
    ),
    (
        "tool and function defer_loading",
        {
            "messages": U,
            "tools": [{"defer_loading": False, "type": "function", "function": {"defer_loading": True, "name": "f"}}],
        },
    ),
    (
        "unknown keys dropped",
        {
            "messages": U,
            "tools": [{"type": "function", "x": 1, "function": {"examples": [1], "name": "f", "description": "d"}}],
        },
    ),
    (
        "unknown function key",
        {"messages": U, "tools": [{"type": "function", "function": {"name": "f", "description": "a", "name2": 0}}]},
    ),
    (
        "schema type aliases",
        {
            "messages": U,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "VARCHAR(255)"},
                                "n": {"type": "int32"},
                                "tags": {"type": "list[str]", "items": {"type": "Text"}},
                                "price": {"type": ["decimal(10,2)", "null", "Number"]},
                                "internal": {"type": "internal"},
                                "m": {"type": "map", "additionalProperties": {"type": "bigint"}},
                                "u": {"anyOf": [{"type": "uuid"}, {"type": " float "}]},
                                "s": {"type": "uint8", "not": {"type": "unsigned long"}},
                            },
                            "$defs": {"x": {"type": "float64"}},
                            "items": {"type": "tinyint"},
                        },
                    },
                }
            ],
        },
    ),
    (
        "schema type list repeats",
        {
            "messages": U,
            "tools": [
                {
                    "function": {
                        "name": "f",
                        "parameters": {"type": ["str", "string", "text", 1, True, 1.0, "dict[str, int]"]},
                    }
                }
            ],
        },
    ),
    ("tool type custom", {"messages": U, "tools": [{"type": "custom", "function": {"name": "f"}}]}),
    ("choice none", {"messages": U, "tools": [W, T], "tool_choice": "none"}),
    ("choice null with tools", {"messages": U, "tools": [W], "tool_choice": None}),
    ("choice required", {"messages": U, "tools": [W, T], "tool_choice": "required"}),
    ("choice required no tools", {"messages": U, "tool_choice": "required"}),
    ("choice required empty tools", {"messages": U, "tools": [], "tool_choice": "required"}),
    (
        "choice named",
        {"messages": U, "tools": [W, T], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    ),
    ("choice named no type", {"messages": U, "tools": [W, T], "tool_choice": {"function": {"name": "get_weather"}}}),
    (
        "choice named unknown",
        {"messages": U, "tools": [W, T], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ),
    ("choice named no name", {"messages": U, "tools": [W], "tool_choice": {"type": "function", "function": {}}}),
    ("choice named no tools", {"messages": U, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("choice auto no tools", {"messages": U, "tool_choice": "auto"}),
    ("choice bad string", {"messages": U, "tools": [W], "tool_choice": "REQUIRED"}),
    (
        "choice bad type",
        {"messages": U, "tools": [W], "tool_choice": {"type": "tool", "function": {"name": "get_weather"}}},
    ),
    ("choice number", {"messages": U, "tools": [W], "tool_choice": 3}),
    ("tools not array", {"messages": U, "tools": {"type": "function"}}),
    ("tool without function", {"messages": U, "tools": [{"type": "function"}]}),
    ("function without name", {"messages": U, "tools": [{"type": "function", "function": {"description": "d"}}]}),
    ("function name number", {"messages": U, "tools": [{"type": "function", "function": {"name": 7}}]}),
    (
        "description number",
        {"messages": U, "tools": [{"type": "function", "function": {"name": "f", "description": 7}}]},
    ),
    ("tools null", {"messages": U, "tools": None}),
    ("ctk enable_thinking false", {"messages": U, "chat_template_kwargs": {"enable_thinking": False}}),
    (
        "ctk values",
        {"messages": U, "chat_template_kwargs": {"b": [1, 2.5, "x", None], "a": {"k": 1}, "enable_thinking": True}},
    ),
    ("ctk null", {"messages": U, "chat_template_kwargs": None}),
    ("ctk not object", {"messages": U, "chat_template_kwargs": [1]}),
    ("ctk chat_template", {"messages": U, "chat_template_kwargs": {"chat_template": "{{ x }}"}}),
    ("effort none", {"messages": U, "reasoning_effort": "none"}),
    ("effort low", {"messages": U, "reasoning_effort": "low"}),
    (
        "effort high ctk override",
        {"messages": U, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
    ),
    ("effort float", {"messages": U, "reasoning_effort": 0.5}),
    ("effort zero", {"messages": U, "reasoning_effort": 0}),
    ("effort numeric string", {"messages": U, "reasoning_effort": "0.25"}),
    ("effort too large", {"messages": U, "reasoning_effort": 1.5}),
    ("effort bool", {"messages": U, "reasoning_effort": True}),
    ("effort unknown", {"messages": U, "reasoning_effort": "extreme"}),
    ("effort with ctk not object", {"messages": U, "reasoning_effort": "low", "chat_template_kwargs": "x"}),
    ("reasoning effort", {"messages": U, "reasoning": {"effort": "medium"}}),
    ("reasoning reasoning_effort", {"messages": U, "reasoning": {"reasoning_effort": "none"}}),
    ("reasoning overrides top level", {"messages": U, "reasoning_effort": "low", "reasoning": {"effort": "high"}}),
    ("reasoning enabled", {"messages": U, "reasoning": {"enabled": True}}),
    ("reasoning enable string", {"messages": U, "reasoning": {"enable": "yes"}}),
    ("reasoning enabled false", {"messages": U, "reasoning": {"enabled": False, "enable": True}}),
    ("reasoning numeric effort", {"messages": U, "reasoning": {"effort": 0.75}}),
    ("reasoning bad effort", {"messages": U, "reasoning": {"effort": "lots"}}),
    ("reasoning effort list", {"messages": U, "reasoning": {"effort": [1]}}),
    ("reasoning not object", {"messages": U, "reasoning": "high"}),
    ("tools and effort", {"messages": U, "tools": [W], "reasoning_effort": "none", "chat_template_kwargs": {"x": 1}}),
]

# Assistant tool calls in the history: SGLang parses their arguments and the template prints
# them with tojson.
H = [
    U[0],
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c","n":1.50,"é":"\\u00e9"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "user", "content": "And tomorrow?"},
]
CASES += [
    ("history tool call", {"messages": H, "tools": [W]}),
    ("history tool call without tools", {"messages": H}),
    (
        "history arguments not json",
        {
            "messages": [
                U[0],
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{city"}}],
                },
            ]
        },
    ),
    (
        "history arguments not an object",
        {
            "messages": [
                U[0],
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                },
            ]
        },
    ),
]

# Bodies served with --default-chat-template-kwargs (the server's defaults, third element).
DEFAULT_CASES = [
    ("defaults fill", {"messages": U}, {"enable_thinking": False, "b": [1]}),
    (
        "defaults lose to the request",
        {"messages": U, "chat_template_kwargs": {"enable_thinking": True}},
        {"enable_thinking": False},
    ),
    ("defaults effort", {"messages": U}, {"reasoning_effort": "low"}),
    ("defaults effort and request effort", {"messages": U, "reasoning_effort": "high"}, {"reasoning_effort": "low"}),
    (
        "defaults after effort none",
        {"messages": U, "reasoning_effort": "none"},
        {"enable_thinking": True, "thinking": True, "z": 0},
    ),
    ("defaults with tools", {"messages": U, "tools": [W]}, {"enable_thinking": False}),
]


def template_inputs(request, default_chat_template_kwargs):
    """The tools the template gets and its extra kwargs (no template reasoning_config: the
    templates the gateway ships)."""
    # _process_messages:
    if default_chat_template_kwargs:
        ctk = dict(request.chat_template_kwargs or {})
        for k, v in default_chat_template_kwargs.items():
            ctk.setdefault(k, v)
        request.chat_template_kwargs = ctk
        effort = ctk.get("reasoning_effort")
        if effort is not None and request.reasoning_effort is None:
            request.reasoning_effort = effort
    effective_tools = Chat._effective_tools(None, request)
    tools = None
    if effective_tools and request.tool_choice != "none":
        if not isinstance(request.tool_choice, str):
            tools = [
                item.model_dump()
                for item in request.tools or []
                if item.function.name == request.tool_choice.function.name
            ] or None
        elif request.tools:
            tools = [item.model_dump() for item in request.tools]
    # _apply_jinja_template:
    extra_template_kwargs = {}
    if request.reasoning_effort is not None:
        extra_template_kwargs["reasoning_effort"] = request.reasoning_effort
    if request.chat_template_kwargs:
        extra_template_kwargs.update(request.chat_template_kwargs)
    return tools, extra_template_kwargs


def qwen3_tokenizer():
    from transformers import AutoTokenizer

    src = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "pkg", "tokenizer", "testdata", "qwen3"
    )
    tmp = tempfile.mkdtemp()
    with (
        gzip.open(os.path.join(src, "tokenizer.json.gz"), "rb") as f,
        open(os.path.join(tmp, "tokenizer.json"), "wb") as out,
    ):
        shutil.copyfileobj(f, out)
    shutil.copy(os.path.join(src, "tokenizer_config.json"), tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    shutil.rmtree(tmp)
    return tok


def choice(request):
    if isinstance(request.tool_choice, ToolChoice):
        return {"function": request.tool_choice.function.name}
    return request.tool_choice


def main():
    tok = qwen3_tokenizer()
    out = []
    for name, body, defaults in [c + (None,) for c in CASES] + DEFAULT_CASES:
        case = {"name": name, "body": body, "defaults": defaults}
        try:
            # A copy: SGLang rewrites tool parameter types in place (normalize_json_schema_types).
            request = ChatCompletionRequest(**copy.deepcopy(body))
        except Exception as e:  # pydantic's ValidationError: SGLang answers 400
            case["invalid"] = str(e).splitlines()[0]
            out.append(case)
            continue
        err = Chat._validate_request(fake_serving(), request)
        if err:
            case["error"] = err
            out.append(case)
            continue
        tools, kwargs = template_inputs(request, defaults)
        case["tool_choice"] = choice(request)
        case["tools"] = None if tools is None else json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
        case["vars"] = json.dumps(kwargs, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        # _apply_jinja_template: the assistant history's arguments parsed (a ValueError is a 400).
        messages = copy.deepcopy(body["messages"])
        try:
            for m in messages:
                serving_chat.normalize_assistant_tool_call_arguments(m, strict=True)
        except ValueError as e:
            case = {"name": name, "body": body, "defaults": defaults, "error": str(e)}
            out.append(case)
            continue
        case["prompt_qwen3"] = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, tools=tools, **kwargs
        )
        out.append(case)
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
