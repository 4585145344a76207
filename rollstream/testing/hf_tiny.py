"""Tiny random Hugging Face models with locally built tokenizers, for tests and checks (never downloads).

`make_tiny_hf_model(dir, arch=...)` saves a randomly initialised Llama or Qwen2 causal LM and a real
`tokenizers` tokenizer (wrapped as a `PreTrainedTokenizerFast`) with `save_pretrained`, so the directory
loads like any local checkpoint (`model.backend=hf model.hf_path=DIR`). Two tokenizers:

  char  one id per character of the built-in tasks' alphabet (CharTokenizer's ids), pad/bos/eos first
  bpe   byte-level BPE trained here on task text, with Qwen2's pre-tokenizer (digits split one by one)

With `chat_template=True` the tokenizer also gets role tokens and a small Jinja chat template (user,
assistant, tool and system turns, each closed by eos), as instruct checkpoints ship one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import torch

from rollstream.model.tokenizer import CHARS, SPECIAL_TOKENS

Arch = Literal["llama", "qwen2"]
TokenizerKind = Literal["char", "bpe"]

ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")

#: Every turn is `<|role|>content<eos>`; the prompt for the model's turn ends with `<|assistant|>`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

#: Qwen2's pre-tokenizer split: letters in words, each digit alone, punctuation runs, whitespace.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _char_tokenizer(specials: list[str]) -> Any:
    """WordLevel over single characters: specials first (pad, bos, eos, ...), then CHARS."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({c: i + len(specials) for i, c in enumerate(CHARS)})
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    return raw


def task_corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Text the BPE tokenizer is trained on: reverse and arith prompts, answers and calculator calls."""
    from rollstream.tasks import ArithToolTask, ReverseTask

    rng = random.Random(seed)
    reverse, arith = ReverseTask(), ArithToolTask()
    out = []
    for _ in range(lines // 2):
        p = reverse.make_prompt(rng)
        out.append(p.text + p.answer)
        q = arith.make_prompt(rng)
        expr = q.text.removesuffix("=?")
        out.append(f"{q.text}[calc:{expr}][={q.answer}]{q.answer}")
    return out


def _bpe_tokenizer(specials: list[str], vocab_size: int, seed: int) -> Any:
    """Byte-level BPE trained on `task_corpus`, Qwen2-style pre-tokenization; specials get the first ids."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(task_corpus(seed=seed), trainer)
    return raw


def build_tokenizer(
    kind: TokenizerKind = "char", chat_template: bool = False, bpe_vocab_size: int = 320
) -> Any:
    """A PreTrainedTokenizerFast: pad/bos/eos are ids 0/1/2; role tokens and CHAT_TEMPLATE when
    `chat_template`."""
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS) + (list(ROLE_TOKENS) if chat_template else [])
    if kind == "char":
        raw = _char_tokenizer(specials)
    elif kind == "bpe":
        raw = _bpe_tokenizer(specials, bpe_vocab_size, seed=0)
    else:
        raise ValueError(f"tokenizer={kind!r}: expected 'char' or 'bpe'")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        additional_special_tokens=list(ROLE_TOKENS) if chat_template else None,
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(
    arch: Arch, vocab_size: int, hidden_size: int = 32, num_layers: int = 2, max_positions: int = 128,
    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None, tied: bool | None = None,
) -> Any:
    """A transformers config of `arch` (4 query / 2 key-value heads and an MLP of 2 x hidden unless given;
    output head tied to the embedding as Qwen2.5 unless `tied` says otherwise: llama untied, qwen2 tied by
    default); pad/bos/eos ids 0/1/2."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, tie_word_embeddings=bool(tied))
    if arch == "qwen2":
        from transformers import Qwen2Config

        # as Qwen2.5-0.5B: tied
        return Qwen2Config(**common, tie_word_embeddings=tied is None or tied, use_sliding_window=False)
    raise ValueError(f"arch={arch!r}: expected 'llama' or 'qwen2'")


def make_tiny_hf_model(
    directory: str | Path,
    seed: int = 0,
    hidden_size: int = 32,
    arch: Arch = "llama",
    tokenizer: TokenizerKind = "char",
    chat_template: bool = False,
    num_layers: int = 2,
    max_positions: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tied: bool | None = None,
) -> Path:
    """Save a tiny random `arch` causal LM + its tokenizer to `directory` (created); returns the path.

    The defaults (Llama, char tokenizer, no chat template) give CharTokenizer's ids exactly. vLLM's CPU
    attention needs a head size (hidden_size / num_heads) of 32 or more. `vocab_size` grows the vocabulary
    with filler tokens to a real model's size (its output head's cost); `tied` overrides the arch's tying (see
    tiny_config)."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(tokenizer, chat_template)
    if vocab_size is not None and vocab_size > len(tok):  # a real model's vocabulary size: filler tokens
        tok.add_tokens([f"<v{i}>" for i in range(vocab_size - len(tok))])
    tok.save_pretrained(str(directory))
    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tok)} tokens")
    cfg = tiny_config(
        arch, vocab_size or len(tok), hidden_size, num_layers, max_positions, num_heads, num_kv_heads,
        intermediate_size, tied,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(directory))
    return directory


def _llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's reordering of a q/k projection's rows for its rotary layout (transformers undoes it on
    load): per head, the two rotary halves interleaved."""
    rows = weight.shape[0]
    split = weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def make_tiny_gguf(path: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Any:
    """Write a tiny random Llama with tied embeddings and the BPE tokenizer with its chat template as a GGUF
    file at `path` (float32 tensors, llama.cpp's names and layout), the way llama.cpp's converter writes one;
    returns the transformers model it holds (for comparing logits)."""
    import gguf
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = build_tokenizer("bpe", chat_template=True)
    common = tiny_config("llama", len(tok), hidden_size, num_layers).to_dict()
    cfg: Any = LlamaConfig(**{**common, "tie_word_embeddings": True})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).eval()
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tok))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab))), "the tiny tokenizer's ids must be dense"
    specials = set(tok.all_special_tokens)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])  # 3: control, 1: normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for key, tensor in model.state_dict().items():
        t = tensor.detach().to(torch.float32)
        if key == "lm_head.weight":
            continue  # tied: llama.cpp writes no output tensor
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, rest = key.split(".", 3)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                t = _llama_cpp_permute(t, heads)
            elif module == "self_attn.k_proj":
                t = _llama_cpp_permute(t, kv_heads)
            name = f"blk.{layer}.{names[module]}.weight"
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
