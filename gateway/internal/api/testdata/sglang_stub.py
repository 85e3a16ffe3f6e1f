"""Imports SGLang 0.5.23's chat serving for the golden generators without a server.

The venv lacks jsonschema (used only to check tool parameter schemas, which the goldens do
not exercise) and xgrammar (output grammars, not used by the parsers' text parsing): stubs
stand in for them. The serving methods are called unbound on a
namespace that has only what the tool and template-kwargs rules read.
"""

import sys
import types

js = types.ModuleType("jsonschema")


class SchemaError(Exception):
    pass


class Draft202012Validator:
    @staticmethod
    def check_schema(schema):
        return None


js.SchemaError = SchemaError
js.Draft202012Validator = Draft202012Validator
sys.modules.setdefault("jsonschema", js)


class _Dummy:
    def __init__(self, *a, **k):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _stub(name):
    """A module of dummy classes for a grammar library the parsers import but never call here."""
    m = types.ModuleType(name)

    def attr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy

    m.__getattr__ = attr
    m.__path__ = []
    sys.modules.setdefault(name, m)


for _name in ("xgrammar", "xgrammar.testing", "xgrammar.structural_tag"):
    _stub(_name)

from sglang.srt.entrypoints.openai import serving_chat  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402, F401 (re-exported)

serving_chat.get_serving = lambda: types.SimpleNamespace(trust_request_chat_template=False, allow_auto_truncate=True)
serving_chat.get_model = lambda: types.SimpleNamespace(context_length=None)

Chat = serving_chat.OpenAIServingChat


def fake_serving(tool_call_parser=None, reasoning_parser=None):
    s = types.SimpleNamespace()
    s.is_minimax_m3 = False
    s.tool_call_parser = tool_call_parser
    s.reasoning_parser = reasoning_parser
    s._validate_media_content = lambda r: None
    s._effective_tools = lambda r: Chat._effective_tools(s, r)
    return s
