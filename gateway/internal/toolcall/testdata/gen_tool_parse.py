"""Goldens for the gateway's answer parsing (parse_test.go): reasoning and tool calls.

Run with SGLang 0.5.23's venv from this folder (sglang_stub.py is the api package's):
    nice ~/.cache/kvcentric/venv-sglang-0.5.23-*/bin/python gen_tool_parse.py > tool_parse.json

Each output goes through SGLang's real ReasoningParser (force_reasoning as serving_chat's
_build_chat_response computes it: the template's detected reasoning mode, then
_get_reasoning_from_request) and then, as _process_tool_calls does for tool_choice "auto",
FunctionCallParser(tools, parser).has_tool_call / parse_non_stream (quoted below).
"""

import json
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "api", "testdata"))
# sglang_stub first: it stands in for the libraries the venv lacks before SGLang imports them.
from sglang_stub import Chat, ChatCompletionRequest  # isort: skip
from sglang.srt.function_call.function_call_parser import FunctionCallParser  # noqa: E402
from sglang.srt.parser.reasoning_parser import ReasoningParser  # noqa: E402
from sglang.srt.parser.template_detection import detect_reasoning_pattern  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = os.path.join(HERE, "..", "..", "..", "..", "pkg", "tokenizer", "testdata")
TEMPLATES = {
    "qwen3": json.load(open(os.path.join(TOK, "qwen3", "tokenizer_config.json")))["chat_template"],
    "qwq": open(os.path.join(TOK, "templates", "Qwen-QwQ-32B.jinja")).read(),
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]
C = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

CASES = [
    # name, template, reasoning parser, tool parser, chat_template_kwargs, output
    ("plain answer", "qwen3", None, "qwen25", None, "It is sunny."),
    ("one call", "qwen3", None, "qwen25", None, C),
    ("text then call", "qwen3", None, "qwen25", None, "Let me check.\n\n" + C),
    ("two calls", "qwen3", None, "qwen25", None, C + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'),
    ("call then text dropped", "qwen3", None, "qwen25", None, C + "\nDone."),
    ("unknown tool", "qwen3", None, "qwen25", None, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
    (
        "known and unknown",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n' + C,
    ),
    (
        "bad json skipped",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>\n' + C,
    ),
    ("only bad json", "qwen3", None, "qwen25", None, 'Hi <tool_call>\n{"name": \n</tool_call>'),
    ("unterminated call", "qwen3", None, "qwen25", None, 'ok <tool_call>\n{"name": "get_time", "arguments": {}}'),
    (
        "parameters key",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n</tool_call>',
    ),
    (
        "empty parameters falls to arguments",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n{"name": "get_time", "parameters": {}, '
        '"arguments": {"a": [1, 2.0, 1e20, true, null]}}\n</tool_call>',
    ),
    ("no arguments", "qwen3", None, "qwen25", None, '<tool_call>\n{"name": "get_time"}\n</tool_call>'),
    (
        "arguments as string",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>',
    ),
    (
        "unicode and key order",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n{"arguments": {"z": "Zürich \\u00e9 \\ud83d\\ude00", "a": "x\\ty"}, '
        '"name": "get_weather"}\n</tool_call>',
    ),
    (
        "list of calls in one block",
        "qwen3",
        None,
        "qwen25",
        None,
        '<tool_call>\n[{"name": "get_time"}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]\n</tool_call>',
    ),
    ("call not an object fails", "qwen3", None, "qwen25", None, 'x <tool_call>\n"get_time"\n</tool_call>'),
    ("name a list fails", "qwen3", None, "qwen25", None, 'x <tool_call>\n{"name": ["get_time"]}\n</tool_call>'),
    ("marker without newline", "qwen3", None, "qwen25", None, '<tool_call>{"name": "get_time"}</tool_call>'),
    (
        "hermes one call",
        "qwen3",
        None,
        "hermes",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    ),
    ("hermes newlines and text", "qwen3", None, "hermes", None, "Checking.\n" + C),
    ("hermes unclosed call", "qwen3", None, "hermes", None, 'ok <tool_call>{"name": "get_time", "arguments": {}}'),
    ("hermes two calls", "qwen3", None, "hermes", None, C + '<tool_call>{"name": "get_time"}</tool_call>'),
    ("hermes bad json fails all", "qwen3", None, "hermes", None, C + '<tool_call>{"name": </tool_call>'),
    ("hermes unknown tool", "qwen3", None, "hermes", None, 'x <tool_call>{"name": "nope"}</tool_call>'),
    ("hermes call not an object", "qwen3", None, "hermes", None, 'x <tool_call>"get_time"</tool_call>'),
    ("hermes empty block", "qwen3", None, "hermes", None, "<tool_call></tool_call>" + C),
    ("hermes list", "qwen3", None, "hermes", None, '<tool_call>[{"name": "get_time"}, {"name": "nope"}]</tool_call>'),
    (
        "reasoning then answer",
        "qwen3",
        "qwen3",
        None,
        None,
        "<think>\nThe user wants weather.\n</think>\n\nIt is sunny.",
    ),
    ("reasoning then call", "qwen3", "qwen3", "qwen25", None, "<think>\nI should call the tool.\n</think>\n\n" + C),
    ("reasoning cut short", "qwen3", "qwen3", "qwen25", None, "<think>\nStill thinking"),
    ("reasoning without start tag", "qwen3", "qwen3", None, None, "thinking...\n</think>\n\nAnswer."),
    ("no think tags", "qwen3", "qwen3", None, None, "Just an answer."),
    ("thinking off", "qwen3", "qwen3", None, {"enable_thinking": False}, "Just an answer."),
    ("thinking off with tags", "qwen3", "qwen3", None, {"enable_thinking": False}, "<think>\nx\n</think>\n\ny"),
    ("call interrupts reasoning", "qwen3", "qwen3", "qwen25", None, "<think>\nI will call\n" + C),
    ("empty reasoning", "qwen3", "qwen3", None, None, "<think>\n\n</think>\n\nHello"),
    ("force nonempty content", "qwen3", "qwen3", None, {"force_nonempty_content": True}, "<think>\nonly thoughts"),
    ("repeated start tags", "qwen3", "qwen3", None, None, "<think><think>a</think>b"),
    ("r1 without start tag", "qwq", "deepseek-r1", None, None, "Let me think.\n</think>\n\nThe answer is 4."),
    ("r1 cut short", "qwq", "deepseek-r1", None, None, "Let me think"),
    ("r1 with call", "qwq", "deepseek-r1", "qwen25", None, "Think\n</think>\n\n" + C),
]


STREAM_CASES = [
    # name, template, reasoning parser, chat_template_kwargs, stream_reasoning, chunks
    ("stream split tags", "qwen3", "qwen3", None, True, ["<th", "ink>\nLet me", " think.</th", "ink>\n\nSunny", "."]),
    ("stream tag in one chunk", "qwen3", "qwen3", None, True, ["<think>a</think>b"]),
    ("stream no tags forced", "qwen3", "qwen3", None, True, ["Just ", "an ", "answer."]),
    ("stream thinking off", "qwen3", "qwen3", {"enable_thinking": False}, True, ["Just ", "<", "an ", "answer."]),
    ("stream thinking off then tags", "qwen3", "qwen3", {"enable_thinking": False}, True, ["ok <think>x</think>y"]),
    ("stream cut short", "qwen3", "qwen3", None, True, ["<think>\nStill", " thinking </thi"]),
    ("stream call interrupts", "qwen3", "qwen3", None, True, ["<think>I will call\n<tool", "_call>\n{}"]),
    ("stream accumulated", "qwen3", "qwen3", None, False, ["<think>a", "b", "c</think>", "d"]),
    ("stream accumulated cut short", "qwen3", "qwen3", None, False, ["<think>a", "b"]),
    ("stream empty chunks", "qwen3", "qwen3", None, True, ["", "<think>", "", "x", "</think>", "", "y"]),
    ("stream force nonempty", "qwen3", "qwen3", {"force_nonempty_content": True}, True, ["<think>only", " thoughts"]),
    ("stream r1", "qwq", "deepseek-r1", None, True, ["Let me", " think.\n</", "think>\n\nFour."]),
    ("stream r1 partial start", "qwq", "deepseek-r1", None, True, ["a <thi", "nk> b"]),
]


def reasoning_force(template, reasoning_parser, request):
    force, config = detect_reasoning_pattern(template)
    serving = types.SimpleNamespace(
        reasoning_parser=reasoning_parser,
        template_manager=types.SimpleNamespace(reasoning_config=config, force_reasoning=force),
    )
    serving._reasoning_detector = ReasoningParser(reasoning_parser).detector
    # _build_chat_response: self.template_manager.force_reasoning or self._get_reasoning_from_request(request)
    return force or Chat._get_reasoning_from_request(serving, request)


def process_tool_calls(parser_name, tools, text, finish):
    """_process_tool_calls for tool_choice "auto" (serving_chat.py 0.5.23)."""
    parser = FunctionCallParser(tools, parser_name)
    if parser.has_tool_call(text):
        try:
            text, call_info_list = parser.parse_non_stream(text)
            if not call_info_list:
                return None, text, finish, "no_call"
            calls = [{"name": c.name, "arguments": c.parameters} for c in call_info_list]
            if finish == "stop":
                finish = "tool_calls"
            return calls, text, finish, ""
        except Exception:
            return None, text, finish, "error"
    return None, text, finish, ""


def main():
    out = []
    for name, tmpl, rp, tp, ctk, text in CASES:
        body = {"messages": [{"role": "user", "content": "x"}]}
        if tp:
            body["tools"] = TOOLS
        if ctk:
            body["chat_template_kwargs"] = ctk
        request = ChatCompletionRequest(**body)
        case = {
            "name": name,
            "template": tmpl,
            "reasoning_parser": rp,
            "tool_call_parser": tp,
            "chat_template_kwargs": ctk,
            "output": text,
        }
        reasoning = None
        if rp:
            force = reasoning_force(TEMPLATES[tmpl], rp, request)
            case["force_reasoning"] = force
            parser = ReasoningParser(model_type=rp, stream_reasoning=False, force_reasoning=force, request=request)
            reasoning, text = parser.parse_non_stream(text)
        calls, finish, fail = None, "stop", ""
        if tp:
            calls, text, finish, fail = process_tool_calls(tp, request.tools, text, finish)
        case.update(
            {
                "content": text if text else "",
                "reasoning_content": reasoning if reasoning else None,
                "tool_calls": calls,
                "finish_reason": finish,
                "failure": fail,
            }
        )
        out.append(case)
    for name, tmpl, rp, ctk, stream_reasoning, chunks in STREAM_CASES:
        body = {"messages": [{"role": "user", "content": "x"}]}
        if ctk:
            body["chat_template_kwargs"] = ctk
        request = ChatCompletionRequest(**body)
        force = reasoning_force(TEMPLATES[tmpl], rp, request)
        # _process_reasoning_stream: ReasoningParser(parser, request.stream_reasoning, force, request)
        parser = ReasoningParser(rp, stream_reasoning, force, request)
        steps = [list(parser.parse_stream_chunk(c)) for c in chunks]
        out.append(
            {
                "name": name,
                "template": tmpl,
                "reasoning_parser": rp,
                "chat_template_kwargs": ctk,
                "stream_reasoning": stream_reasoning,
                "force_reasoning": force,
                "chunks": chunks,
                "steps": steps,
                "end": list(parser.parse_stream_end()),
            }
        )
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
