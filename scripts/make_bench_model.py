"""Writes a random-weight GGUF of a real model's shape, in f16, with the
default model's tokenizer (SmolLM2's 49152 tokens), for speed tests:
decode and prefill cost depends on the shapes, not on the values. Tensors
are generated and written one at a time, so an 8B file needs no more
memory than its largest tensor.

Usage: make_bench_model.py SHAPE TOKENIZER.gguf OUT.gguf
  SHAPE: 1b (Llama-3.2-1B), 3b (Llama-3.2-3B), 8b (Llama-3.1-8B), or
  3b-smollm: not random at all, but the default model's own weights
  carried inside the 3B's matrices (see `carry`), so that a 3B-sized
  model answers as SmolLM2-135M does: speculative decoding's acceptance
  needs a model that really echoes its prompt, which random weights never
  do, while its speed needs the 3B's cost.
Called by scripts/make-bench-model, which quantizes the result.
"""

import sys

import gguf
import numpy as np

# The published configurations (config.json of each release). Llama 3.2
# ties the output matrix to the token embeddings; Llama 3.1 8B does not.
SHAPES = {
    "1b": dict(name="Llama-3.2-1B", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, tied=True),
    "3b": dict(name="Llama-3.2-3B", layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192, tied=True),
    "8b": dict(name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, tied=False),
    # The 3B's widths with SmolLM2-135M's 30 layers (the 3B has 28), to
    # carry the small model layer for layer: 7% more weights than the 3B.
    "3b-smollm": dict(name="Llama-3.2-3B", layers=30, hidden=3072, heads=24, kv_heads=8, ffn=8192, tied=True),
}
CONTEXT = 8192
ROPE_BASE = 500000.0
RMS_EPS = 1e-5
# Small enough that activations stay finite through every layer.
WEIGHT_STD = 0.02


def copy_tokenizer(reader, writer):
    """Every `tokenizer.*` key of the default model, as stored."""
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        elif kind == gguf.GGUFValueType.UINT32:
            writer.add_uint32(key, value)
        elif kind == gguf.GGUFValueType.INT32:
            writer.add_int32(key, value)
        elif kind == gguf.GGUFValueType.FLOAT32:
            writer.add_float32(key, value)
        else:
            raise SystemExit(f"tokenizer key {key} of type {kind} is not copied")
    if vocab == 0:
        raise SystemExit("the tokenizer model has no tokenizer.ggml.tokens")
    return vocab


def tensors(shape, vocab):
    """(name, shape as rows x cols, is a norm) of every tensor, in order."""
    h, ffn = shape["hidden"], shape["ffn"]
    head_dim = h // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    out = [("token_embd.weight", (vocab, h), False)]
    for layer in range(shape["layers"]):
        p = f"blk.{layer}."
        out += [
            (p + "attn_norm.weight", (h,), True),
            (p + "attn_q.weight", (h, h), False),
            (p + "attn_k.weight", (kv, h), False),
            (p + "attn_v.weight", (kv, h), False),
            (p + "attn_output.weight", (h, h), False),
            (p + "ffn_norm.weight", (h,), True),
            (p + "ffn_gate.weight", (ffn, h), False),
            (p + "ffn_up.weight", (ffn, h), False),
            (p + "ffn_down.weight", (h, ffn), False),
        ]
    out.append(("output_norm.weight", (h,), True))
    if not shape["tied"]:
        out.append(("output.weight", (vocab, h), False))
    return out


class Carry:
    """The default model's weights placed inside a wider model's matrices so
    that the wide model computes exactly the small one's function (up to
    rounding): every extra row and column is zero, so the residual stream's
    extra dimensions stay zero and extra heads add nothing.
    - Each small head's dimensions are the first ones of a wide head; with
      heads twice as wide, RoPE's pair i turns at base^(-2i/wide), so the
      base is squared to keep the small model's angles, and queries are
      scaled by sqrt(wide/small) to keep its 1/sqrt(head_dim) scores.
    - RMSNorm over the wide width sees the same sum of squares divided by
      more dimensions: norm weights are scaled by sqrt(small/wide) and eps
      by small/wide, which gives back the small model's normalized values.
    """

    def __init__(self, reader, shape):
        self.reader = reader
        self.tensors = {t.name: t for t in reader.tensors}
        field = lambda key: reader.fields[key].contents()
        self.hidden = field("llama.embedding_length")
        self.heads = field("llama.attention.head_count")
        self.kv_heads = field("llama.attention.head_count_kv")
        self.ffn = field("llama.feed_forward_length")
        self.head_dim = self.hidden // self.heads
        self.wide_head_dim = shape["hidden"] // shape["heads"]
        fits = (
            field("llama.block_count") == shape["layers"]
            and self.heads * shape["kv_heads"] == self.kv_heads * shape["heads"]
            and self.heads <= shape["heads"]
            and self.wide_head_dim == 2 * self.head_dim
            and self.ffn <= shape["ffn"]
        )
        if not fits:
            raise SystemExit("the default model does not fit this shape's layers, heads and widths")
        self.shape = shape
        self.rope_base = field("llama.rope.freq_base") ** 2
        self.rms_eps = field("llama.attention.layer_norm_rms_epsilon") * self.hidden / shape["hidden"]

    def small(self, name):
        t = self.tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    def head_rows(self, name, heads, scale=1.0):
        """Each small head's rows at the start of its wide head."""
        old = self.small(name)
        new = np.zeros((heads * self.wide_head_dim, self.shape["hidden"]), np.float32)
        for h in range(old.shape[0] // self.head_dim):
            rows = old[h * self.head_dim : (h + 1) * self.head_dim]
            new[h * self.wide_head_dim : h * self.wide_head_dim + self.head_dim, : self.hidden] = rows * scale
        return new

    def values(self, name, dims):
        base = name.rsplit(".", 2)[-2] if name.startswith("blk.") else name.split(".")[0]
        if base in ("attn_norm", "ffn_norm", "output_norm"):
            new = np.zeros(dims, np.float32)
            new[: self.hidden] = self.small(name) * np.sqrt(self.hidden / self.shape["hidden"])
            return new
        if base == "attn_q":
            return self.head_rows(name, self.shape["heads"], np.sqrt(self.wide_head_dim / self.head_dim))
        if base in ("attn_k", "attn_v"):
            return self.head_rows(name, self.shape["kv_heads"])
        new = np.zeros(dims, np.float32)
        old = self.small(name)
        if base == "attn_output":
            for h in range(self.heads):
                at = h * self.wide_head_dim
                new[: self.hidden, at : at + self.head_dim] = old[:, h * self.head_dim : (h + 1) * self.head_dim]
        else:
            # token_embd, ffn_gate, ffn_up, ffn_down: the top-left corner.
            new[: old.shape[0], : old.shape[1]] = old
        return new


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in SHAPES:
        raise SystemExit(__doc__)
    shape = SHAPES[sys.argv[1]]
    reader = gguf.GGUFReader(sys.argv[2])
    carry = Carry(reader, shape) if sys.argv[1] == "3b-smollm" else None
    writer = gguf.GGUFWriter(sys.argv[3], "llama")
    if carry:
        writer.add_name(f"SmolLM2-135M-Instruct carried in a {shape['name']} shape (speed tests only)")
    else:
        writer.add_name(f"random {shape['name']} shape (speed tests only)")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(carry.rope_base if carry else ROPE_BASE)
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_layer_norm_rms_eps(carry.rms_eps if carry else RMS_EPS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_tokenizer(reader, writer)
    writer.add_vocab_size(vocab)
    plan = tensors(shape, vocab)
    for name, dims, norm in plan:
        dtype = np.float32 if norm else np.float16
        count = int(np.prod(dims))
        # GGUF lists dimensions innermost first; gguf-py takes numpy order.
        writer.add_tensor_info(name, dims, np.dtype(dtype), count * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for index, (name, dims, norm) in enumerate(plan):
        if carry:
            values = carry.values(name, dims)
            values = values if norm else values.astype(np.float16)
        elif norm:
            values = np.ones(dims, dtype=np.float32)
        else:
            values = (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
        writer.write_tensor_data(values)
        done = index + 1
        if done * 10 // len(plan) != index * 10 // len(plan) or done == len(plan):
            print(f"{done}/{len(plan)} tensors written", file=sys.stderr, flush=True)
    writer.close()


if __name__ == "__main__":
    main()
