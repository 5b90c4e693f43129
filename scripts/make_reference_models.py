#!/usr/bin/env python3
"""Tiny random checkpoints of the families the engine runs, and what Hugging
Face transformers answers with them: the engine's reference fixtures.

Run through scripts/make-reference-models (which makes the virtualenv with the
pinned torch/transformers/tokenizers/safetensors); by hand:

    python scripts/make_reference_models.py OUT_DIR [--llama-cpp DIR]

For every case it writes OUT_DIR/<case>/ with config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json, reference.json and, where the engine should read it,
model.gguf (llama.cpp's own convert_hf_to_gguf.py, f16).

Everything is seeded: a rerun with the same versions writes the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
import tokenizers
import safetensors
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Gemma2Config,
    Gemma3TextConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    SmolLM3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Qwen3_5TextConfig,
    Qwen3_5MoeTextConfig,
)

VOCAB = 512
GREEDY_STEPS = 24
TOP_LOGPROBS = 5

# The pre-tokenizer regexes of Llama 3 and Qwen 2 as their tokenizer.json
# files spell them (llama.cpp's "llama-bpe" and "qwen2").
RX_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
RX_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]

# A ChatML template; the Llama/Mistral flavour writes bos_token first, as
# Llama 3's and Mistral's own templates do.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_BOS = "{{ bos_token }}" + CHATML

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A cluster of small machines can
run a model that does not fit on one of them: each machine holds some layers,
or a slice of every layer, and they pass activations over the network.
Attention looks back over the tokens so far; the feed-forward block mixes each
position on its own. Rotary position embeddings turn queries and keys by an
angle that grows with the position. Grouped-query attention shares each key
and value head among several query heads, which keeps the cache small.
What is the capital of France? Paris is the capital of France, and Berlin is
the capital of Germany. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159.
Please write a short poem about the sea. The sea is wide, the sea is deep,
the waves come in, the gulls will sleep. Hello! How are you today? I'm fine,
thanks; we've been busy, they'll come later, you'd like some tea? It's late.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Café, naïve, résumé, jalapeño: accents in words. Emoji: 🚀 ✅ 🦙.
"""

PROMPTS_RAW = [
    "The quick brown fox",
    "Attention looks back over the tokens so far, and the cluster",
    "def add(a, b):\n    return",
]
PROMPTS_CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please write a short poem about the sea."},
        {"role": "assistant", "content": "The sea is wide, the sea is deep."},
        {"role": "user", "content": "Café? 🚀 42 more, please!"},
    ],
]


def train_sentencepiece(out: Path) -> PreTrainedTokenizerFast:
    """Gemma's kind of tokenizer: a SentencePiece BPE of VOCAB pieces with
    byte fallback and no space put first, saved as tokenizer.model (which
    llama.cpp's converter reads) and as transformers' GemmaTokenizer."""
    import sentencepiece

    text = out / "training.txt"
    text.write_text(TRAINING_TEXT * 4)
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        # Control pieces: transformers makes them special added tokens and
        # llama.cpp's converter control tokens, as Gemma's turn markers are.
        control_symbols=["<|im_start|>", "<|im_end|>"],
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        add_dummy_prefix=False, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2,
    )
    text.unlink()
    (out / "tokenizer.vocab").unlink()
    tokenizer = transformers.GemmaTokenizer.from_pretrained(
        out, eos_token="<|im_end|>", bos_token="<bos>", pad_token="<pad>",
        add_bos_token=True, chat_template=CHATML_BOS,
    )
    tokenizer.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


# Each flavour's BOS (None: none) and padding token.
SPECIAL_OF = {
    "llama": ("<|begin_of_text|>", "<|endoftext|>"),
    "qwen": (None, "<|endoftext|>"),
    "sentencepiece": ("<bos>", "<pad>"),
}


def train_tokenizer(flavour: str, out: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE of VOCAB tokens with the family's pre-tokenizer, or
    (flavour "sentencepiece") a SentencePiece one."""
    if flavour == "sentencepiece":
        return train_sentencepiece(out)
    regex = RX_LLAMA3 if flavour == "llama" else RX_QWEN2
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=flavour == "llama"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer)
    bos = "<|begin_of_text|>"
    if flavour == "llama":
        # Llama 3's post-processor: BOS before every sequence.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = dict(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_BOS if flavour == "llama" else CHATML,
    )
    if flavour == "llama":
        kwargs.update(bos_token=bos, add_bos_token=True)
    fast = PreTrainedTokenizerFast(**kwargs)
    fast.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with a larger scale than transformers' init, so that logits
    are far apart: norms near 1, projections and biases clearly non-zero.
    Gemma's, Qwen3-Next's and Qwen3.5's norms scale by (1 + weight): there
    the weights are near 0 (but for the gated norm of linear attention,
    which scales by the weight itself)."""
    gen = torch.Generator().manual_seed(seed)
    zero_centred = model.config.model_type.startswith(("gemma", "qwen3_next", "qwen3_5"))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                plain = not zero_centred or name.endswith("linear_attn.norm.weight")
                offset = 1.0 if plain else 0.0
                p.copy_(offset + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (8.0 / math.sqrt(p.shape[-1])))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / math.sqrt(fan_in)))


def top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = torch.topk(logprobs, k)
    return [(int(i), float(v)) for i, v in zip(ids, values)]


def reset_rope(model) -> None:
    """transformers' dynamic RoPE is stateful: it keeps the frequencies of the
    longest sequence seen until one shorter than the original context comes.
    Reset before every generation, so that each prompt's answer is a function
    of that prompt alone."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "original_max_seq_len"):
            module.register_buffer("inv_freq", module.original_inv_freq.clone(), persistent=False)
            module.max_seq_len_cached = module.original_max_seq_len


def uses_dynamic_rope(model) -> bool:
    params = getattr(model.config, "rope_parameters", None) or {}
    return params.get("rope_type") == "dynamic"


def next_logprobs(model, seq: list[int], cache) -> tuple[torch.Tensor, object]:
    """The log-softmax after `seq`, in float64. Without a cache the whole
    sequence is run again. With one (dynamic RoPE), only the tokens it lacks
    are run, as `generate` does: the prompt in one pass rotated with the base
    for its length, then each new token with the base for the sequence's
    length at that step, while the keys already cached keep their rotation.
    (A recompute would rotate every earlier key with each step's base, which
    no KV cache can reproduce; `generate` is what transformers' users get.)"""
    if cache is None:
        reset_rope(model)
        logits = model(torch.tensor([seq])).logits[0, -1]
        return torch.log_softmax(logits.to(torch.float64), dim=-1), None
    if cache is True:
        reset_rope(model)
        out = model(torch.tensor([seq]), use_cache=True)
    else:
        out = model(torch.tensor([seq[-1:]]), cache=cache, use_cache=True)
    logits = out.logits[0, -1].to(torch.float64)
    return torch.log_softmax(logits, dim=-1), out.cache


def run_prompt(model, ids: list[int]) -> dict:
    """Greedy continuation, per-step top-1/top-2 margins, first step's top-5
    log-softmax; in float64. Each step reruns the whole sequence (no cache),
    except with dynamic RoPE (see `next_logprobs`)."""
    seq = list(ids)
    out, margins, first = [], [], None
    cache = True if uses_dynamic_rope(model) else None
    with torch.no_grad():
        for step in range(GREEDY_STEPS):
            logprobs, cache = next_logprobs(model, seq, cache)
            best = top(logprobs, TOP_LOGPROBS)
            if step == 0:
                first = best
            margins.append(best[0][1] - best[1][1])
            out.append(best[0][0])
            seq.append(best[0][0])
    return {
        "prompt_ids": list(ids),
        "greedy_ids": out,
        "margins": margins,
        "first_top_logprobs": [[i, v] for i, v in first],
    }


def chat_ids(tokenizer, messages) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def reference(model, tokenizer) -> dict:
    cases = []
    for text in PROMPTS_RAW:
        ids = tokenizer(text)["input_ids"]
        cases.append({"kind": "raw", "text": text, **run_prompt(model, ids)})
    for messages in PROMPTS_CHAT:
        ids = chat_ids(tokenizer, messages)
        cases.append({"kind": "chat", "messages": messages, **run_prompt(model, ids)})
    return {
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
        },
        "greedy_steps": GREEDY_STEPS,
        "prompts": cases,
    }


# name: (config class, tokenizer flavour, config kwargs, tied embeddings, make a GGUF)
def cases() -> dict:
    llama = dict(
        hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    small = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    return {
        "llama": (LlamaConfig, "llama", dict(
            **llama, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), False, True),
        "llama-rope-llama3": (LlamaConfig, "llama", dict(
            **small, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}), True, True),
        "llama-rope-linear": (LlamaConfig, "llama", dict(
            **small, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                      "factor": 4.0}), False, True),
        # Prompts of 9-22 tokens cross max_position_embeddings while they
        # generate, the 103-token one starts beyond it; factor x 32 = 128
        # positions hold the longest.
        "llama-rope-dynamic": (LlamaConfig, "llama", dict(
            **small | {"max_position_embeddings": 32}, rope_parameters={
                "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}), False, False),
        "llama-rope-yarn": (LlamaConfig, "llama", dict(
            **small, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 128, "beta_fast": 32.0,
                "beta_slow": 1.0}), False, True),
        "mistral": (MistralConfig, "llama", dict(
            **small, head_dim=32, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), True, True),
        "mistral-sliding-window": (MistralConfig, "llama", dict(
            **small, head_dim=32, sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), True, False),
        "qwen2": (Qwen2Config, "qwen", dict(
            **llama | {"rms_norm_eps": 1e-6},
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False), True, True),
        "qwen3": (Qwen3Config, "qwen", dict(
            **small, head_dim=32, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False), True, True),
        # Last, so that adding it left the other cases' seeds alone.
        "llama-bias": (LlamaConfig, "llama", dict(
            **small, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), False, True),
        # Mixtures of experts: 8 experts, 2 per token, in every layer; the
        # router's softmax weights renormalised (Mixtral always, Qwen3-MoE
        # with norm_topk_prob) or not.
        "qwen3-moe": (Qwen3MoeConfig, "qwen", dict(
            **small | {"num_hidden_layers": 3}, head_dim=32, attention_bias=False,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False), False, True),
        # Not renormalised, and layer 1 dense (intermediate_size rows): no
        # GGUF, as llama.cpp's qwen3moe has neither.
        "qwen3-moe-dense-layer": (Qwen3MoeConfig, "qwen", dict(
            **small | {"num_hidden_layers": 3}, head_dim=32, attention_bias=False,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False), True, False),
        "mixtral": (MixtralConfig, "llama", dict(
            **small, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), False, True),
        # Fused q/k/v and gate/up projections.
        "phi3": (Phi3Config, "llama", dict(
            **small, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            original_max_position_embeddings=512, sliding_window=None), False, True),
        # Every fourth layer without RoPE (llama.cpp fixes the interval at 4).
        "smollm3": (SmolLM3Config, "llama", dict(
            **small | {"num_hidden_layers": 4}, no_rope_layer_interval=4,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}), True, True),
        # Norms after attention and MLP instead of before; q and k normed
        # across all heads.
        "olmo2": (Olmo2Config, "llama", dict(
            **small, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
            False, True),
        # Scaled embeddings, (1 + w) norms before and after each block, GeGLU,
        # both soft caps (low enough to bite), every other layer sliding.
        "gemma2": (Gemma2Config, "sentencepiece", dict(
            **small | {"num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=32,
            hidden_activation="gelu_pytorch_tanh", sliding_window=8,
            attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), True, True),
        # Five sliding layers to one global, q/k norms, local RoPE base 10000
        # and a linearly scaled global one.
        "gemma3": (Gemma3TextConfig, "sentencepiece", dict(
            **small | {"num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=32,
            hidden_activation="gelu_pytorch_tanh", sliding_window=8,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
            True, True),
        # LongRoPE stretched 128 times beyond an original context of 4, so
        # that every prompt is past it and transformers (which picks the
        # factors by the sequence's length) uses the long ones throughout,
        # as the engine does for a context beyond the original.
        "phi3-longrope": (Phi3Config, "llama", dict(
            **small, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0,
                "long_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]},
            original_max_position_embeddings=4, sliding_window=None), False, True),
        # Hybrid attention: three Gated DeltaNet (linear attention) layers to
        # one gated full-attention layer with partial RoPE (a quarter of the
        # head), 2 key heads to 4 value heads in the linear layers.
        "qwen3-5": (Qwen3_5TextConfig, "qwen", dict(
            **small | {"num_hidden_layers": 4}, head_dim=32, **LINEAR_ATTENTION,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25}), True, True),
        # Qwen3-Next: q/k/v/z and b/a fused per key head, experts with a
        # gated shared expert in every layer (llama.cpp's qwen3next has no
        # dense layers).
        "qwen3-next": (Qwen3NextConfig, "qwen", dict(
            **small | {"num_hidden_layers": 4}, head_dim=32, **LINEAR_ATTENTION,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=96, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25}), False, True),
        "qwen3-5-moe": (Qwen3_5MoeTextConfig, "qwen", dict(
            **{k: v for k, v in small.items() if k != "intermediate_size"}
            | {"num_hidden_layers": 4}, head_dim=32, **LINEAR_ATTENTION,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25}), False, True),
        # LongRoPE stretched 4 times (1024 over an original 256, Phi-3.5's
        # layout at a smaller scale), every sequence shorter than the
        # original context: the short factors, with the attention factor
        # sqrt(1 + ln 4 / ln 256) all the same.
        "phi3-longrope-short": (Phi3Config, "llama", dict(
            **small | {"max_position_embeddings": 1024}, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                "long_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]},
            original_max_position_embeddings=256, sliding_window=262144), False, True),
        # The same stretch over an original context of 32: the 9-22 token
        # prompts cross it while they generate (transformers' Phi-3
        # `generate` then computes the whole sequence again with the long
        # factors; the reference reruns every step whole, which is the
        # same), the 103-token prompt starts beyond it.
        "phi3-longrope-crossing": (Phi3Config, "llama", dict(
            **small | {"max_position_embeddings": 128}, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0,
                "long_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]},
            original_max_position_embeddings=32, sliding_window=None), False, True),
    }


# The linear-attention dimensions of the hybrid cases.
LINEAR_ATTENTION = dict(
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4,
)


def old_layout(config: dict) -> dict:
    """The config as transformers 4 wrote it: rope_theta and rope_scaling at
    the top level (no rope_parameters)."""
    config = dict(config)
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = None if params.get("rope_type") == "default" else params
    return config


def convert_gguf(case_dir: Path, llama_cpp: Path, pre: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py, f16. It names the pre-tokenizer by
    hashing the tokens of a fixed text, which only a published vocabulary
    matches; ours is trained here, so the name it would recognise for this
    pre-tokenizer (llama-bpe, qwen2) is given instead. Phi-3's converter
    reads only a sentencepiece tokenizer.model (as Gemma 2's does); where a
    case's tokenizer is byte-level BPE, they read it as the others do (the
    GPT-2 way). Nothing else is changed."""
    extra = hybrid_convert_args(json.loads((case_dir / "config.json").read_text()))
    wrapper = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(llama_cpp)!r})\n"
        f"sys.path.insert(0, {str(llama_cpp / 'gguf-py')!r})\n"
        "import conversion.base as base\n"
        "import conversion.gemma as gemma, conversion.phi as phi\n"
        f"base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n"
        "phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()\n"
        f"if not {(case_dir / 'tokenizer.model').is_file()!r}:\n"
        "    gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(case_dir)!r}, '--outtype', 'f16',"
        f" '--outfile', {str(case_dir / 'model.gguf')!r}] + {extra!r}\n"
        f"runpy.run_path({str(llama_cpp / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", wrapper], check=True)


def hybrid_convert_args(config: dict) -> list[str]:
    """Qwen3-Next's and Qwen3.5's converters expect a multi-token
    prediction head unless told the checkpoint has none (ours have none)."""
    return ["--no-mtp"] if config.get("model_type", "").startswith(("qwen3_next", "qwen3_5")) else []


def load_float64(case_dir: Path, **kwargs):
    """The saved files in float64. Experts run eagerly (expert by expert):
    transformers' default grouped kernel has no float64."""
    config = json.loads((case_dir / "config.json").read_text())
    if config.get("num_local_experts") or config.get("num_experts"):
        kwargs["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(case_dir, dtype=torch.float64, **kwargs).eval()


def make_case(out: Path, name: str, spec, llama_cpp: Path | None, seed: int) -> None:
    config_class, flavour, kwargs, tied, gguf = spec
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    tokenizer = train_tokenizer(flavour, case_dir)
    bos_token, pad_token = SPECIAL_OF[flavour]
    bos = tokenizer.convert_tokens_to_ids(bos_token) if bos_token else None
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = config_class(
        vocab_size=VOCAB, tie_word_embeddings=tied, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=tokenizer.convert_tokens_to_ids(pad_token), **kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    # Stored as bf16: the reference runs on exactly the stored weights.
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, do_sample=False)
    model.save_pretrained(case_dir, safe_serialization=True)
    # The reference is what transformers answers with the saved files (the
    # model in memory has had its RoPE frequencies rounded to bf16 by .to()).
    model = load_float64(case_dir)
    ref = reference(model, tokenizer)
    ref["case"] = name
    (case_dir / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    if gguf and llama_cpp is not None:
        convert_gguf(case_dir, llama_cpp, "qwen2" if flavour == "qwen" else "llama-bpe")
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters", file=sys.stderr)


def make_bench_moe(out: Path, llama_cpp: Path) -> None:
    """A larger random Qwen3-MoE for the speed figure (not a test fixture):
    12 layers of 64 experts, 8 per token, 256 rows each, hidden 1024 (the
    expert to hidden ratio and top-k of Qwen3-30B-A3B, scaled down), about
    640 MB once quantized to Q8_0. Written as safetensors and converted to
    an f16 GGUF (model.gguf) for llama-quantize."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer = train_tokenizer("qwen", out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-6, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, 7)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    del model
    convert_gguf(out, llama_cpp, "qwen2")
    print(f"wrote {out / 'model.gguf'}", file=sys.stderr)


SENTENCEPIECE_TEXTS = [
    "The quick brown fox",
    "  two leading spaces",
    "Café? 🚀 42 more, please!",
    "a\n\nb  c",
    "def add(a, b):\n    return a + b",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


def make_sentencepiece_llama(out: Path, llama_cpp: Path, server: Path) -> None:
    """A Llama 2 style SentencePiece vocabulary (a space put first, byte
    fallback, control tokens) in a one-layer random Llama, converted to GGUF,
    and what llama.cpp's own tokenizer (llama-server's /tokenize) makes of
    SENTENCEPIECE_TEXTS, with and without special tokens parsed: the
    reference for the engine's SentencePiece GGUF tokenizer where a space is
    put first (the Gemma cases cover the other kind against transformers)."""
    import sentencepiece
    import time
    import urllib.request

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    work = out / "hf"
    work.mkdir()
    (work / "training.txt").write_text(TRAINING_TEXT * 4)
    sentencepiece.SentencePieceTrainer.train(
        input=str(work / "training.txt"), model_prefix=str(work / "tokenizer"), vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        control_symbols=["<|im_start|>", "<|im_end|>"], pad_id=0, eos_id=2, bos_id=1, unk_id=3,
        pad_piece="<pad>", eos_piece="</s>", bos_piece="<s>", unk_piece="<unk>",
        add_dummy_prefix=True, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2,
    )
    tokenizer = transformers.LlamaTokenizer.from_pretrained(
        work, bos_token="<s>", eos_token="</s>", add_bos_token=True, legacy=True)
    tokenizer.save_pretrained(work)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(work)
    convert_gguf(work, llama_cpp, "llama-bpe")
    (work / "model.gguf").rename(out / "model.gguf")
    shutil.rmtree(work)
    port = 18777
    proc = subprocess.Popen([str(server), "-m", str(out / "model.gguf"), "--port", str(port),
                             "-c", "256"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cases = []
        for text in SENTENCEPIECE_TEXTS:
            for special in (False, True):
                body = json.dumps({"content": text, "add_special": True,
                                   "parse_special": special}).encode()
                for _ in range(100):
                    try:
                        request = urllib.request.Request(
                            f"http://127.0.0.1:{port}/tokenize", data=body,
                            headers={"Content-Type": "application/json"})
                        ids = json.load(urllib.request.urlopen(request))["tokens"]
                        break
                    except OSError:
                        time.sleep(0.2)
                else:
                    raise RuntimeError("llama-server did not answer")
                cases.append({"text": text, "parse_special": special, "ids": ids})
    finally:
        proc.terminate()
    (out / "llama_cpp_tokens.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def f16_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager causal attention with the engine's (and llama.cpp's) roundings:
    queries, keys and values in f16, attention weights rounded to f16."""
    from transformers.integrations.sdpa_attention import repeat_kv

    def f16(x):
        return x.to(torch.float16).to(x.dtype)

    q, k, v = f16(query), f16(key), f16(value)
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    rows, cols = scores.shape[-2:]
    causal = torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)
    if kwargs.get("sliding_window"):
        # transformers' window: key j is seen from query i when i - j < window.
        causal &= ~torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows - kwargs["sliding_window"])
    weights = f16(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


def explain_f16(out: Path) -> None:
    """How far the f16 attention alone moves the first-step top-5 logprobs
    from the float64 reference, per case (the engine's tolerance is 0.1)."""
    from transformers import AttentionInterface

    AttentionInterface.register("tessera_f16", f16_attention)
    for case_dir in sorted(p for p in out.iterdir() if (p / "reference.json").is_file()):
        ref = json.loads((case_dir / "reference.json").read_text())
        try:
            model = load_float64(case_dir, attn_implementation="tessera_f16")
        except Exception as error:  # a case whose config needs another attention
            print(f"{case_dir.name}: skipped ({error})")
            continue
        worst = 0.0
        for prompt in ref["prompts"]:
            reset_rope(model)
            with torch.no_grad():
                logits = model(torch.tensor([prompt["prompt_ids"]])).logits[0, -1]
            logprobs = torch.log_softmax(logits.to(torch.float64), dim=-1)
            for token, value in prompt["first_top_logprobs"]:
                worst = max(worst, abs(float(logprobs[token]) - value))
        print(f"{case_dir.name}: f16 attention moves first-step top-5 logprobs by up to {worst:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, default=None,
                        help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--bench-moe", action="store_true",
                        help="write only a larger random Qwen3-MoE (about 600M parameters) "
                             "into OUT, for the MoE speed figure")
    parser.add_argument("--sentencepiece-llama", type=Path, default=None, metavar="LLAMA_SERVER",
                        help="write only the SentencePiece tokenizer fixture into OUT, with "
                             "the ids this llama-server's /tokenize gives")
    parser.add_argument("--explain-f16", action="store_true",
                        help="write nothing; print how much f16 attention alone moves each "
                             "case's first-step logprobs")
    args = parser.parse_args()
    if args.explain_f16:
        explain_f16(args.out)
        return
    if args.sentencepiece_llama:
        make_sentencepiece_llama(args.out, args.llama_cpp, args.sentencepiece_llama)
        return
    if args.bench_moe:
        make_bench_moe(args.out, args.llama_cpp)
        return
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for seed, (name, spec) in enumerate(cases().items()):
        if args.only and name not in args.only:
            continue
        make_case(args.out, name, spec, args.llama_cpp, 1000 + seed)
    # The same weights and tokenizer with the older config layout.
    src, dst = args.out / "llama-rope-llama3", args.out / "llama-rope-llama3-old-config"
    if src.exists() and (not args.only or "llama-rope-llama3" in args.only):
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        (dst / "model.gguf").unlink(missing_ok=True)
        config = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(old_layout(config), indent=2) + "\n")
        # transformers 5 still reads the old layout: check it answers the same.
        model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float64).eval()
        tokenizer = AutoTokenizer.from_pretrained(dst)
        ref = reference(model, tokenizer)
        ref["case"] = dst.name
        old = json.loads((src / "reference.json").read_text())
        assert [p["greedy_ids"] for p in ref["prompts"]] == [p["greedy_ids"] for p in old["prompts"]]
        (dst / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


if __name__ == "__main__":
    main()
