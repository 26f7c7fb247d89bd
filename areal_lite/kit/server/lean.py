"""Loading a Llama/Qwen2-family checkpoint without transformers, for the fast path: a server starts seconds sooner.

Design decisions
- Why: importing transformers and its model classes costs a server process about 4 s of CPU at every start (they
  pull in torch.distributed.tensor, torch._dynamo, sympy, scipy), many times what reading the weights costs, and
  tests and notebooks start servers dozens of times (bench/server_start.py measures both ways). The fast path
  (`fastpath.FastRunner`) reads only the weights, the norms' epsilon, the attention scaling and the rotary tables,
  so a plain module tree with transformers' parameter names serves it, and `tokenizers` (which transformers' fast
  tokenizers wrap) does the text.
- Only what this reproduces exactly (`lean_files`): model_type llama or qwen2, default RoPE, SiLU, no MLP bias, no
  sliding window, one-shard or indexed safetensors, and a tokenizer.json whose transformers class adds nothing to it
  (`TokenizersBackend`, `PreTrainedTokenizerFast`, no BOS/EOS added, no clean-up). Anything else, `--no-fast-path`
  and AREAL_LITE_SERVER_TRANSFORMERS=1 load through transformers (`weights.load_model`).
- The same numbers and names: parameters named and tied as transformers names and ties them (weight updates and
  LoRA adapters address them by name), RMSNorm epsilon and rotary tables computed by the same float32 operations;
  tests/test_serve.py holds state dicts, rotary tables, logits and tokenization to transformers' bit for bit.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["LeanCausalLM", "LeanTokenizer", "lean_files", "load_lean", "read_config", "model_json"]

_CONFIG_DEFAULTS = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False, "pretraining_tp": 1}
_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def model_json(path: str) -> dict:
    """A JSON file of a model folder."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_config(path: str) -> types.SimpleNamespace:
    """config.json of folder `path` as attributes, with the defaults transformers' Llama/Qwen2 configs take."""
    raw = model_json(os.path.join(path, "config.json"))
    cfg = types.SimpleNamespace(**{**_CONFIG_DEFAULTS, **raw})
    cfg.head_dim = raw.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    cfg.rope_type = rope.get("rope_type", rope.get("type", "default"))
    cfg.rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    return cfg


def lean_files(path: str) -> Optional[str]:
    """Why folder `path` cannot load lean (see the module docstring), or None when it can."""
    try:
        cfg = read_config(path)
        tok = model_json(os.path.join(path, "tokenizer_config.json"))
    except (OSError, ValueError, AttributeError, TypeError) as e:
        return f"config: {e}"
    if cfg.model_type not in ("llama", "qwen2") or cfg.rope_type != "default":
        return f"model_type {cfg.model_type!r}, rope {cfg.rope_type!r}"
    if cfg.hidden_act != "silu" or cfg.mlp_bias or cfg.use_sliding_window or cfg.pretraining_tp != 1:
        return "an MLP, attention window or tensor split the fast path does not reproduce"
    if tok.get("tokenizer_class") not in _PLAIN_TOKENIZERS or tok.get("clean_up_tokenization_spaces"):
        return f"tokenizer class {tok.get('tokenizer_class')!r}"
    if tok.get("add_bos_token") or tok.get("add_eos_token"):
        return "the tokenizer adds BOS/EOS tokens"
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or not _weight_files(path):
        return "no tokenizer.json or safetensors weights"
    return None


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return sorted({os.path.join(path, f) for f in model_json(index)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def load_lean(path: str, dtype: torch.dtype, device: torch.device) -> tuple[LeanCausalLM, LeanTokenizer]:
    """The model (eval, no gradients, on `device` in `dtype`) and tokenizer of a folder `lean_files` accepts."""
    from safetensors.torch import load_file

    model = LeanCausalLM(read_config(path))
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        state.update(load_file(f))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor for both, as transformers ties them
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie()
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.model.rotary_emb = _Rotary(model.config, device)  # float32 tables whatever the weights, as transformers
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        model.generation_config = types.SimpleNamespace(**model_json(gen))
    return model, LeanTokenizer(path)


class _Dense(nn.Module):
    """`nn.Linear`'s parameters (and names) without its initialisation: empty on the meta device until `load_lean`
    assigns the checkpoint's. (Initialising on meta, or a `torch.device("meta")` block, imports torch's Python
    decompositions: a large share of a start, bench/server_start.py.)"""

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, device="meta"))
        self.bias = nn.Parameter(torch.empty(n_out, device="meta")) if bias else None


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.variance_epsilon = eps


class _Rotary(nn.Module):
    """transformers' default RoPE tables (`LlamaRotaryEmbedding.forward`), operation for operation."""

    def __init__(self, cfg: Any, device: torch.device):
        super().__init__()
        dim = cfg.head_dim
        # a plain attribute, not a buffer: `Module.to(dtype)` must not round it (the tables are float32 math)
        self.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))  # Qwen2: q/k/v always
        self.q_proj = _Dense(cfg.hidden_size, h * d, bias=bias)
        self.k_proj = _Dense(cfg.hidden_size, kv * d, bias=bias)
        self.v_proj = _Dense(cfg.hidden_size, kv * d, bias=bias)
        self.o_proj = _Dense(h * d, cfg.hidden_size, bias=bool(getattr(cfg, "attention_bias", False)))
        self.scaling = d**-0.5


class _MLP(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.gate_proj = _Dense(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = _Dense(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = _Dense(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Inner(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.embed_tokens = _Dense(cfg.hidden_size, cfg.vocab_size, bias=False)  # `weight` [vocab, hidden]
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb: Optional[_Rotary] = None  # `load_lean` builds it once the weights are in place


class LeanCausalLM(nn.Module):
    """The parameters of a Llama/Qwen2 causal LM under transformers' names, for `fastpath.FastRunner`; it has no
    forward of its own (the runner computes). Built empty on the meta device: `load_lean` assigns the checkpoint's
    tensors.
    """

    def __init__(self, cfg: Any):
        super().__init__()
        self.config = cfg
        self.generation_config = None  # `load_lean` sets it from generation_config.json when the folder has one
        self.model = _Inner(cfg)
        self.lm_head = _Dense(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def tie(self) -> None:
        """lm_head shares the embedding's parameter where the config ties them (as transformers does)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> _Dense:
        return self.model.embed_tokens


class LeanTokenizer:
    """What the server asks of a transformers fast tokenizer, from the same tokenizer.json: `tok(text)["input_ids"]`,
    `decode`, `eos_token_id`, `get_vocab`, `backend_tokenizer`."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        eos = model_json(os.path.join(path, "tokenizer_config.json")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self.backend_tokenizer.token_to_id(eos) if isinstance(eos, str) else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)
