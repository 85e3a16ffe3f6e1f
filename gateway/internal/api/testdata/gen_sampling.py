"""Goldens for the worker's sampling_params (sampling_test.go).

Run with SGLang 0.5.23's venv from this folder:
    nice ~/.cache/kvcentric/venv-sglang-0.5.23-*/bin/python gen_sampling.py > sampling.json

Each body goes through SGLang's real request model (ChatCompletionRequest or CompletionRequest:
pydantic validation), the serving class's checks (OpenAIServingChat._validate_request,
OpenAIServingCompletion._validate_request), its sampling_params (ChatCompletionRequest
.to_sampling_params with the jinja template's stop, request.stop; OpenAIServingCompletion
._build_sampling_params), then SamplingParams(**sampling_params).normalize(tokenizer) and
.verify(vocab_size) as TokenizerManager does. A /generate body's sampling_params go straight to
SamplingParams. Recorded per case: the sampling_params as json.dumps(separators=(",", ":"),
ensure_ascii=False) writes them, or the error (kind "pydantic": the request model refused it;
"value": SGLang's ValueError, whose message is kept).

Two rules are the gateway's, applied here so the goldens compare what it sends:
- a body without a max tokens field (a /generate body: max_new_tokens absent or null) gets the
  gateway's --default-max-tokens (DEFAULT_MAX below) where SGLang has None (chat, /generate's
  null), 16 (completions) or 128 (/generate);
- logit_bias keys are bounded by the worker (the gateway does not know the vocabulary):
  verify runs with VOCAB.
The gateway's own refusals of bodies SGLang accepts (OpenAI's logit_bias bound, a number sent as
a string) and its own wording of some SGLang refusals are listed in sampling_test.go
(gatewayRefuses, gatewayWords).
"""

import json
import sys
import types

from sglang_stub import ChatCompletionRequest, fake_serving  # isort: skip
from sglang.srt.entrypoints.openai.protocol import (  # noqa: E402
    CompletionRequest,
    LegacyStructuralTagResponseFormat,
    ResponseFormat,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat  # noqa: E402
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

DEFAULT_MAX = 256
VOCAB = 1 << 62
U = [{"role": "user", "content": "hi"}]
P = "hello"


class Tok:
    """normalize() measures stop strings in tokens; the count is not sent."""

    def encode(self, s, add_special_tokens=False):
        return list(s.encode())


def chat(**kw):
    return ("chat", {"messages": U, "max_tokens": 32, **kw})


def comp(**kw):
    return ("completions", {"prompt": P, "max_tokens": 32, **kw})


def gen(sp):
    return ("generate", {"text": P, "sampling_params": sp})


SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "é"]}}, "required": ["a"]}

CASES = [
    ("chat defaults", chat()),
    ("chat no max tokens", ("chat", {"messages": U})),
    ("chat max_completion_tokens", chat(max_completion_tokens=7)),
    ("chat greedy", chat(temperature=0)),
    ("chat temperature int", chat(temperature=2)),
    ("chat temperature float", chat(temperature=0.7, top_p=0.9)),
    ("chat temperature negative", chat(temperature=-0.5)),
    ("chat top_p zero", chat(top_p=0)),
    ("chat top_p above one", chat(top_p=1.5)),
    ("chat top_k", chat(top_k=40, min_p=0.05)),
    ("chat top_k zero", chat(top_k=0)),
    ("chat top_k zero greedy", chat(top_k=0, temperature=0)),
    ("chat top_k minus two", chat(top_k=-2)),
    ("chat top_k float", chat(top_k=3.0)),
    ("chat top_k fraction", chat(top_k=3.5)),
    ("chat min_p above one", chat(min_p=1.5)),
    ("chat stop string", chat(stop="\n\n")),
    ("chat stop list", chat(stop=["END", "é", ""])),
    ("chat stop empty list", chat(stop=[])),
    ("chat stop null", chat(stop=None)),
    ("chat stop number", chat(stop=5)),
    ("chat stop 33", chat(stop=[str(i) for i in range(33)])),
    ("chat stop_token_ids", chat(stop_token_ids=[151645, 7])),
    ("chat stop_regex", chat(stop_regex="a+b")),
    ("chat stop_regex long", chat(stop_regex="x" * 257)),
    ("chat seed", chat(seed=42)),
    ("chat seed negative", chat(seed=-(2**63))),
    ("chat seed too large", chat(seed=2**63)),
    ("chat penalties", chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.1)),
    ("chat presence_penalty out", chat(presence_penalty=2.5)),
    ("chat frequency_penalty out", chat(frequency_penalty=-3)),
    ("chat repetition_penalty zero", chat(repetition_penalty=0)),
    ("chat repetition_penalty out", chat(repetition_penalty=2.01)),
    ("chat min_tokens", chat(min_tokens=4, ignore_eos=True, no_stop_trim=True)),
    ("chat min_tokens above max", chat(min_tokens=40)),
    ("chat min_tokens negative", chat(min_tokens=-1)),
    ("chat skip_special_tokens false", chat(skip_special_tokens=False)),
    ("chat spaces kwarg", chat(chat_template_kwargs={"spaces_between_special_tokens": False})),
    ("chat logit_bias", chat(logit_bias={"5": 1, "10": -100, "5 ": 2.5, "7": 100})),
    ("chat logit_bias negative key", chat(logit_bias={"-1": 1})),
    ("chat logit_bias bad key", chat(logit_bias={"x": 1})),
    ("chat logit_bias above 100", chat(logit_bias={"5": 1, "10": 100.5})),
    ("chat logit_bias below -100", chat(logit_bias={"10": -101})),
    ("chat logit_bias string value", chat(logit_bias={"5": "1"})),
    ("chat logit_bias null value", chat(logit_bias={"5": None})),
    ("chat logit_bias list", chat(logit_bias=[5])),
    ("chat regex", chat(regex="[a-z]+")),
    ("chat ebnf", chat(ebnf='root ::= "a"')),
    ("chat regex and ebnf", chat(regex="a", ebnf='root ::= "a"')),
    ("chat response_format text", chat(response_format={"type": "text"})),
    ("chat response_format json_object", chat(response_format={"type": "json_object"})),
    (
        "chat response_format json_schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
    ),
    (
        "chat response_format json_schema strict false",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}}),
    ),
    ("chat response_format top schema", chat(response_format={"type": "json_schema", "schema": SCHEMA})),
    (
        "chat response_format no schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
    ),
    ("chat response_format no name", chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})),
    ("chat response_format and regex", chat(response_format={"type": "json_object"}, regex="a")),
    ("chat response_format bad type", chat(response_format={"type": "yaml"})),
    ("chat custom_params", chat(custom_params={"k": [1, 2.5, None], "a": "b"})),
    ("chat temperature string", chat(temperature="0.5")),
    ("chat ignore_eos string", chat(ignore_eos="yes")),
    ("completions defaults", comp()),
    ("completions no max tokens", ("completions", {"prompt": P})),
    ("completions sampling", comp(temperature=0.2, top_p=0.5, top_k=5, seed=1, stop=["x"], min_tokens=1)),
    ("completions json_schema field", comp(json_schema='{"type":"string"}')),
    (
        "completions response_format json_schema",
        comp(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
    ),
    (
        "completions response_format json_object and field",
        comp(json_schema="{}", response_format={"type": "json_object"}),
    ),
    (
        "completions response_format no schema",
        comp(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
    ),
    ("completions max_tokens zero", comp(max_tokens=0)),
    ("completions top_p above one", comp(top_p=2)),
    ("completions temperature null", comp(temperature=None)),
    ("completions logit_bias", comp(logit_bias={"50256": -100})),
    ("completions logit_bias above 100", comp(logit_bias={"50256": 150})),
    ("generate max only", gen({"max_new_tokens": 8})),
    ("generate sampling", gen({"temperature": 0, "top_k": 1, "stop": "x", "sampling_seed": 3, "max_new_tokens": 8})),
    ("generate nulls", gen({"temperature": None, "top_p": None, "max_new_tokens": 8})),
    ("generate no max", gen({"temperature": 0.5})),
    ("generate top_p zero", gen({"top_p": 0, "max_new_tokens": 8})),
    ("generate temperature negative", gen({"temperature": -1, "max_new_tokens": 8})),
    ("generate top_k zero", gen({"top_k": 0, "max_new_tokens": 8})),
    ("generate min above max", gen({"min_new_tokens": 9, "max_new_tokens": 8})),
    ("generate grammars", gen({"regex": "a", "json_schema": "{}", "max_new_tokens": 8})),
    ("generate empty grammar", gen({"regex": "", "json_schema": "{}", "max_new_tokens": 8})),
    ("generate seed float", gen({"sampling_seed": 1.5, "max_new_tokens": 8})),
    ("generate unknown key", gen({"temprature": 0.5, "max_new_tokens": 8})),
    ("generate logit_bias beyond 100", gen({"logit_bias": {"5": 150}, "max_new_tokens": 8})),
    ("generate logit_bias bad key", gen({"logit_bias": {"x": 1}, "max_new_tokens": 8})),
]


# A model's generation_config.json (the gateway's --generation-config; SGLang's
# --sampling-defaults model reads it from the model folder) for the cases named here.
QWEN3_GC = {"bos_token_id": 151643, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
GENERATION_CONFIGS = {
    "chat generation config": QWEN3_GC,
    "chat generation config overridden": QWEN3_GC,
    "chat generation config greedy": QWEN3_GC,
    "chat generation config ints": {"temperature": 1, "repetition_penalty": 1.05, "min_p": None},
    "completions generation config ignored": QWEN3_GC,
}
CASES += [
    ("chat generation config", chat()),
    ("chat generation config overridden", chat(temperature=0.2, top_k=None)),
    ("chat generation config greedy", chat(temperature=0)),
    ("chat generation config ints", chat(top_p=0.5)),
    ("completions generation config ignored", comp()),
]


def model_defaults(gc):
    """ModelConfig.get_default_sampling_params with --sampling-defaults model."""
    if gc is None:
        return {}
    cfg = types.SimpleNamespace(sampling_defaults="model", hf_generation_config=GenerationConfig.from_dict(gc))
    return ModelConfig.get_default_sampling_params(cfg)


def dumps(v):
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def check(sp):
    s = SamplingParams(**sp)
    s.normalize(Tok())
    s.verify(VOCAB)


def run(api, body, gc):
    if api == "generate":
        sp = dict(body["sampling_params"])
        if sp.get("max_new_tokens") is None:
            sp["max_new_tokens"] = DEFAULT_MAX
        try:
            check(dict(sp))
        except (ValueError, TypeError) as e:
            return {"error": str(e), "error_kind": "value" if isinstance(e, ValueError) else "type"}
        return {"sampling_params": dumps(sp)}
    model = ChatCompletionRequest if api == "chat" else CompletionRequest
    try:
        req = model(**json.loads(json.dumps(body)))
        if isinstance(req.response_format, dict):
            # The stub's StructuralTag (xgrammar's, absent here) takes anything: the union's
            # real members decide, as xgrammar's model would refuse these bodies.
            try:
                req.response_format = ResponseFormat.model_validate(req.response_format)
            except Exception:
                req.response_format = LegacyStructuralTagResponseFormat.model_validate(req.response_format)
    except Exception as e:  # pydantic's ValidationError: SGLang answers 400
        return {"error": type(e).__name__, "error_kind": "pydantic"}
    try:
        if api == "chat":
            msg = OpenAIServingChat._validate_request(fake_serving(), req)
            if msg:
                raise ValueError(msg)
            sp = req.to_sampling_params(stop=req.stop, model_generation_config=model_defaults(gc))
        else:
            msg = OpenAIServingCompletion._validate_request(None, req)
            if msg:
                raise ValueError(msg)
            sp = OpenAIServingCompletion._build_sampling_params(None, req)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            sp["max_new_tokens"] = DEFAULT_MAX
        check(dict(sp))
    except ValueError as e:
        return {"error": str(e), "error_kind": "value"}
    return {"sampling_params": dumps(sp)}


def main():
    out = []
    for name, (api, body) in CASES:
        case = {"name": name, "api": api, "body": dumps(body)}
        gc = GENERATION_CONFIGS.get(name)
        if gc is not None:
            case["generation_config"] = dumps(gc)
        case.update(run(api, body, gc))
        out.append(case)
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
