"""The reference model: a Qwen3-style causal LM built from a config, weights from a fixed seed.

Every worker of a run builds the same weights without any download: each parameter is filled by
its own generator seeded from (seed, parameter name), on the target device, so the weights do
not depend on construction order or on transformers' own init. (On CUDA the same seed gives the
same weights on the same GPU type and torch version; a run uses one of each.)

The forward pass is transformers' own Qwen3 (the same code SGLang's reference numerics are
compared against); KV lives in the paged pool (pool.py) and is gathered into a DynamicCache for
each forward and the new tokens' KV scattered back.
"""

import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_positions: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


SPECS = {
    # CPU tests: Qwen3-like, GQA (4 heads over 2 KV heads), fp32 so that equalities are exact.
    "tiny": ModelSpec(
        "tiny",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        max_positions=1 << 17,
    ),
    # GPU timing: Qwen3-8B's full configuration (config.json of Qwen/Qwen3-8B), random weights.
    "qwen3-8b-shape": ModelSpec(
        "qwen3-8b-shape",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        max_positions=40960,
    ),
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def spec_for(name: str, dtype: str = "") -> ModelSpec:
    if name not in SPECS:
        raise ValueError("unknown model %r (want one of %s)" % (name, ", ".join(sorted(SPECS))))
    s = SPECS[name]
    if dtype:
        if dtype not in DTYPES:
            raise ValueError("unknown dtype %r (want one of %s)" % (dtype, ", ".join(sorted(DTYPES))))
        s = ModelSpec(**{**s.__dict__, "dtype": DTYPES[dtype]})
    return s


ATTENTION = "kvc_sdpa"  # the attention implementation name registered with transformers (below)


def _kvc_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Attention for one sequence (batch 1, no padding), by shape, on fused SDPA kernels only:
    a decode step (one query) attends to every key; a prefill from scratch (as many queries as
    keys) is causal; an append-prefill (queries < keys: the tail after a resident or received
    past) is causal aligned to the bottom right (query i sits at position keys - queries + i).
    Stock transformers materializes a boolean (queries x keys) mask for the last case and
    repeats K/V per query head, which keeps SDPA off its fused kernels; this does neither.
    query is (1, heads, q, d), key/value (1, kv_heads, k, d); returns (1, q, heads, d)."""
    F = torch.nn.functional
    q, k = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if q == 1:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
    elif q == k:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=True, enable_gqa=gqa)
    else:
        from torch.nn.attention.bias import causal_lower_right

        if gqa:  # the lower-right causal bias dispatches without GQA support: repeat K/V heads
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q, k), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # _kvc_attention derives the causal structure from the shapes


_REGISTERED = False


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _kvc_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    _REGISTERED = True


def attention_for(device: str, choice: str = "auto") -> str:
    """The attention implementation: "sdpa" (transformers' stock one) or "kvc" (_kvc_attention);
    auto picks kvc on CUDA (fused kernels for append-prefills) and sdpa elsewhere."""
    if choice not in ("auto", "sdpa", "kvc"):
        raise ValueError("unknown attention %r (want auto, sdpa or kvc)" % choice)
    if choice == "auto":
        choice = "kvc" if str(device).startswith("cuda") else "sdpa"
    return choice


def _config(spec: ModelSpec, attention: str = "sdpa"):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=False,
        use_sliding_window=False,
        attention_dropout=0.0,
    )
    try:  # transformers 5.x: rope settings live in rope_parameters
        cfg = Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    except TypeError:
        cfg = Qwen3Config(**kw, rope_theta=spec.rope_theta)
    if attention == "kvc":
        _register_attention()
        cfg._attn_implementation = ATTENTION
    else:
        cfg._attn_implementation = "sdpa"
    return cfg


QK_GAIN = 2.0


def _fill(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights: N(0, 0.02) for matrices and embeddings, 1 for norms but the
    per-head q/k norms (QK_GAIN)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # Sharper attention than a random model's near-uniform one (scores ~ N(0, QK_GAIN^4)):
                # the output then depends on which KV sits at which position, so a misplaced or
                # stale page changes the logits instead of averaging away.
                p.fill_(QK_GAIN)
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = torch.Generator(device=p.device)
            g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
            p.normal_(0.0, 0.02, generator=g)


def build(spec: ModelSpec, device: str, seed: int = 1234, attention: str = "auto"):
    """Builds the model on device in spec.dtype with the seed's weights (eval mode, no grad);
    attention: see attention_for."""
    from transformers import Qwen3ForCausalLM

    cfg = _config(spec, attention_for(device, attention))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(spec.dtype if spec.dtype.is_floating_point else prev)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to(device=device, dtype=spec.dtype)
    _fill(model, seed)
    model.eval()
    model.requires_grad_(False)
    return model


def new_cache(model, k_layers=None, v_layers=None):
    """A DynamicCache holding per-layer K/V of shape (tokens, kv_heads, head_dim) (or empty)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if k_layers is not None and k_layers[0].shape[0] > 0:
        for l, (k, v) in enumerate(zip(k_layers, v_layers)):
            cache.update(k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous(), l)
    return cache


def cache_len(cache) -> int:
    return cache.get_seq_length()


def cache_kv(cache, layer: int, start: int, end: int):
    """K and V of tokens [start, end) of a layer as (tokens, kv_heads, head_dim)."""
    lay = cache.layers[layer]
    return (lay.keys[0, :, start:end, :].transpose(0, 1), lay.values[0, :, start:end, :].transpose(0, 1))


@torch.no_grad()
def forward(model, ids, cache, all_logits: bool = False):
    """Runs ids (a list or 1-D tensor) after the cache's tokens; returns float32 logits of the
    last position (or of every position with all_logits) and the cache, extended."""
    dev = next(model.parameters()).device
    t = torch.as_tensor(ids, dtype=torch.long, device=dev).reshape(1, -1)
    kw = {_cache_kwarg(model): cache}
    out = model(input_ids=t, use_cache=True, logits_to_keep=0 if all_logits else 1, **kw)
    logits = out.logits[0].float()
    return (logits if all_logits else logits[-1]), cache  # the cache is extended in place


_CACHE_KW = {}


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the forward's cache argument `cache` (past_key_values is
    deprecated there); 5.17 (the GPU machine's) and older call it past_key_values."""
    cls = type(model)
    if cls not in _CACHE_KW:
        import inspect

        params = inspect.signature(cls.forward).parameters
        _CACHE_KW[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[cls]
