#!/usr/bin/env python3
"""Embedding references: tiny random sentence-transformers checkpoints of the
encoder families the engine embeds with, and what sentence-transformers
answers for a varied set of texts; and the same answers for the real
all-MiniLM-L6-v2 (the offline default, from its PyPI package).

Run in the reference virtualenv (scripts/make-reference-models makes it)
with sentence-transformers installed:

    python scripts/make_embedding_references.py OUT_DIR [--minilm DIR]

For every case it writes OUT_DIR/<case>/ as sentence-transformers saves a
model (config.json, model.safetensors, tokenizer files, modules.json,
1_Pooling/, 2_Normalize/ where it normalises, sentence_bert_config.json)
plus reference.json: the texts, each one's token ids and its embedding.
With --minilm it writes OUT_DIR/all-minilm-l6-v2.json for the real model.

Weights are seeded; the tokenizer trainers may break ties differently from
run to run (see the fixtures' README).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer, models
from tokenizers import decoders, normalizers, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertModel, BertTokenizerFast, PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

# Qwen 2's pre-tokenizer regex, as its tokenizer.json has it.
RX_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Empty, short, long (past the tiny models' 64 tokens), non-Latin, emoji,
# odd whitespace, accents and mixed case.
TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " ".join(
        "A cluster of ordinary machines serves one large model by splitting "
        "its layers, and every node folds the same ordered log of events "
        "into the same state, so any of them can answer.".split()
        * 6
    ),
    "Привет, мир! Как дела?",
    "東京は日本の首都です。",
    "emoji 🎉🚀 party 👩‍💻",
    "  spaces\tand\nnewlines  ",
    "Ça va très bien, MERCI beaucoup — naïve café.",
]

CORPUS = (
    "the quick brown fox jumps over the lazy dog . a cluster of machines "
    "serves models , splits layers , and folds one log of events into state . "
    "hello world ! how are you ? tokyo is the capital of japan . emoji party . "
    "machines nodes events state model layer split serve answer text word "
) * 20


def wordpiece(size: int) -> tokenizers.Tokenizer:
    """A lowercasing WordPiece of `size` tokens, with BERT's specials and
    post-processor, trained on the built-in corpus."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=specials)
    tok.train_from_iterator([CORPUS], trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


def tiny_bert(out: Path, pooling: str, normalize: bool, seed: int) -> None:
    torch.manual_seed(seed)
    work = out.with_suffix(".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = wordpiece(512)
    fast = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True)
    fast.save_pretrained(work)
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
    )
    model = BertModel(config)
    # Weights larger than the init's, so that layers change the states.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.mul_(8.0)
    model.save_pretrained(work, safe_serialization=True)
    body = models.Transformer(str(work), max_seq_length=64)
    pool = models.Pooling(body.get_word_embedding_dimension(), pooling_mode=pooling)
    modules = [body, pool] + ([models.Normalize()] if normalize else [])
    st = SentenceTransformer(modules=modules, device="cpu")
    shutil.rmtree(out, ignore_errors=True)
    st.save(str(out))
    # The model card sentence-transformers writes says nothing the tests use.
    (out / "README.md").unlink(missing_ok=True)
    shutil.rmtree(work)
    reference(st, out / "reference.json")


def byte_bpe(size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE of `size` tokens with Qwen 2's pre-tokenizer and
    Qwen3-Embedding's post-processor (<|endoftext|> after every text, the
    token its last-token pooling reads), trained on the built-in corpus."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(RX_QWEN2), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    end = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", end)]
    )
    return tok


def tiny_qwen3(out: Path, seed: int, llama_cpp: Path | None) -> None:
    """A decoder embedder as Qwen3-Embedding is one: a Qwen3 model without
    its head, last-token pooling, normalized; and, with llama.cpp, the same
    folder as llama.cpp's converter makes a GGUF of it (model.gguf, f32)."""
    torch.manual_seed(seed)
    work = out.with_suffix(".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = byte_bpe(400)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.padding_side = "left"
    fast.save_pretrained(work)
    config = Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|endoftext|>"),
    )
    model = Qwen3Model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    model.save_pretrained(work, safe_serialization=True)
    body = models.Transformer(str(work), max_seq_length=64)
    pool = models.Pooling(body.get_word_embedding_dimension(), pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[body, pool, models.Normalize()], device="cpu")
    shutil.rmtree(out, ignore_errors=True)
    st.save(str(out))
    (out / "README.md").unlink(missing_ok=True)
    shutil.rmtree(work)
    reference(st, out / "reference.json", batch_size=1)
    if llama_cpp:
        convert_gguf(out, llama_cpp)


NOMIC_CODE = ("configuration_hf_nomic_bert.py", "modeling_hf_nomic_bert.py")


def tiny_nomic(out: Path, seed: int, contrastors: Path) -> None:
    """nomic-bert as nomic-embed-text-v1.5 configures it (rotary, SwiGLU,
    no biases, post-norm, a padded vocabulary), mean pooling, normalized.
    The reference is nomic's own modeling code, which sentence-transformers
    loads with trust_remote_code as it does for the real model: its two
    files are taken from a checkout of github.com/nomic-ai/contrastors
    (src/contrastors/models/huggingface/) for the run and are not kept in
    the fixture."""
    torch.manual_seed(seed)
    work = out.with_suffix(".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = wordpiece(512)
    fast = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True)
    fast.save_pretrained(work)
    code = contrastors / "src/contrastors/models/huggingface"
    for name in NOMIC_CODE:
        shutil.copy(code / name, work / name)
    sys.path.insert(0, str(code))
    from configuration_hf_nomic_bert import NomicBertConfig  # noqa: E402

    config = NomicBertConfig(
        vocab_size=tok.get_vocab_size(), n_embd=32, n_head=4, n_inner=256, n_layer=2, n_positions=128,
        activation_function="swiglu", rotary_emb_fraction=1.0, rotary_emb_base=1000, qkv_proj_bias=False,
        mlp_fc1_bias=False, mlp_fc2_bias=False, prenorm=False, layer_norm_epsilon=1e-12, type_vocab_size=2,
        use_flash_attn=False, fused_bias_fc=False, fused_dropout_add_ln=False, use_xentropy=False,
        max_trained_positions=128, causal=False, pad_vocab_size_multiple=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=3,
        # As nomic-embed-text's config: its attention applies attn_pdrop
        # even in eval mode.
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )
    config.auto_map = {
        "AutoConfig": "configuration_hf_nomic_bert.NomicBertConfig",
        "AutoModel": "modeling_hf_nomic_bert.NomicBertModel",
    }
    config.save_pretrained(work)
    model = transformers.AutoModel.from_config(
        transformers.AutoConfig.from_pretrained(work, trust_remote_code=True), trust_remote_code=True
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "emb_ln" not in name:
                p.mul_(8.0)
    model.save_pretrained(work, safe_serialization=True)
    remote = {"trust_remote_code": True}
    body = models.Transformer(str(work), max_seq_length=64, model_kwargs=remote, config_kwargs=remote)
    # transformers 5 dropped PreTrainedModel.get_extended_attention_mask,
    # which the remote code calls: transformers 4's, for a 2-D mask.
    type(body.auto_model).get_extended_attention_mask = lambda self, mask, shape, *a, **k: (
        (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
    )
    pool = models.Pooling(body.get_word_embedding_dimension(), pooling_mode="mean")
    st = SentenceTransformer(modules=[body, pool, models.Normalize()], device="cpu")
    shutil.rmtree(out, ignore_errors=True)
    st.save(str(out))
    (out / "README.md").unlink(missing_ok=True)
    shutil.rmtree(work)
    reference(st, out / "reference.json")
    # The fixture keeps the weights and config, not nomic's code.
    for name in NOMIC_CODE:
        (out / name).unlink(missing_ok=True)
    saved = json.loads((out / "config.json").read_text())
    saved.pop("auto_map", None)
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def convert_gguf(folder: Path, llama_cpp: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py, f32, told the pre-tokenizer's name
    (it names one by hashing the tokens of a fixed text, which only a
    published vocabulary matches; ours is trained here)."""
    wrapper = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(llama_cpp)!r})\n"
        f"sys.path.insert(0, {str(llama_cpp / 'gguf-py')!r})\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outtype', 'f32',"
        f" '--outfile', {str(folder / 'model.gguf')!r}]\n"
        f"runpy.run_path({str(llama_cpp / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", wrapper], check=True)


def reference(st: SentenceTransformer, path: Path, batch_size: int = 4) -> None:
    tokenizer = st.tokenizer
    ids = [tokenizer(t, truncation=True, max_length=st.max_seq_length)["input_ids"] for t in TEXTS]
    embeddings = st.encode(TEXTS, convert_to_numpy=True, batch_size=batch_size)
    path.write_text(
        json.dumps(
            {
                "texts": TEXTS,
                "token_ids": ids,
                "embeddings": [[round(float(x), 7) for x in row] for row in embeddings],
            },
            ensure_ascii=False,
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--minilm", type=Path, help="the all-MiniLM-L6-v2 folder")
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree (its converter makes the GGUFs)")
    parser.add_argument("--contrastors", type=Path, help="a checkout of nomic-ai/contrastors (nomic-bert's code)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tiny_bert(args.out / "bert-mean", "mean", True, 1)
    tiny_bert(args.out / "bert-cls", "cls", False, 2)
    tiny_qwen3(args.out / "qwen3-last", 3, args.llama_cpp)
    if args.contrastors:
        tiny_nomic(args.out / "nomic-bert", 4, args.contrastors)
    if args.minilm:
        st = SentenceTransformer(str(args.minilm), device="cpu")
        reference(st, args.out / "all-minilm-l6-v2.json")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"sentence-transformers {sentence_transformers.__version__}, tokenizers {tokenizers.__version__}"
    )


if __name__ == "__main__":
    main()
