#!/usr/bin/env python3
"""Writes the small random-weight GGUF models the tests serve with a real llama-server.

Usage: make-test-model.py LLAMA_CPP_SOURCE OUT_DIR

Writes OUT_DIR/tiny.gguf (a chat model) and OUT_DIR/tiny-embed.gguf (served with
`--embedding --pooling mean`). Both are llama architectures with f16 weights and the
tokenizer of the source's vocab-only file models/ggml-vocab-llama-spm.gguf (32,000 tokens),
with three of its byte tokens named fill-in-the-middle tokens (so llama-server serves `/infill`),
and without the tokenizer's added space prefix (so a JSON schema's grammar can start).
The weights are random with a fixed seed, so the text they produce is noise; the tokenizer,
slots, KV cache, prompt cache, timings and HTTP API are the engine's own. The chat model is
large enough (dim 384, 6 layers) that prefill on CPU is slow enough to tell a prompt-cache hit
from a miss.

Needs numpy and llama.cpp's own gguf-py (from the same source) installed.
"""

import os
import sys
from pathlib import Path

import numpy as np
import gguf

VOCAB_FILE = "models/ggml-vocab-llama-spm.gguf"

# A ChatML-like template written as plain text: the SPM vocabulary has no ChatML special tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Copies every tokenizer.* key of the vocab-only file; returns the vocabulary size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        main_type = field.types[0]
        if main_type == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, main_type, sub_type=field.types[1])
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, value, main_type)
    if n_vocab == 0:
        sys.exit(f"{VOCAB_FILE} has no tokenizer.ggml.tokens")
    return n_vocab


# Fill-in-the-middle tokens: the SPM vocabulary has none of its own, so three byte tokens that
# text seldom holds (<0x00>, <0x01>, <0x02>) stand for prefix, suffix and middle. llama-server
# answers `/infill` with 501 when any of the three is missing.
FIM_TOKENS = {
    gguf.Keys.Tokenizer.FIM_PRE_ID: "<0x00>",
    gguf.Keys.Tokenizer.FIM_SUF_ID: "<0x01>",
    gguf.Keys.Tokenizer.FIM_MID_ID: "<0x02>",
}


def add_fim_tokens(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    for key, text in FIM_TOKENS.items():
        if text not in tokens:
            sys.exit(f"{VOCAB_FILE} has no token {text}")
        writer.add_uint32(key, tokens.index(text))


# No space prefix: with one, the SPM tokenizer writes the generation prompt `<|im_start|>assistant\n`
# as ` <`, `|`, `im`… (token 529, " <", first). llama-server builds a `response_format`'s grammar
# with that prompt as its literal start and feeds the prompt's tokens through it, dropping a first
# token that begins with a space the prompt does not have: ` <` goes, `<` with it, the grammar
# then meets `|` and throws, and every `response_format` is a 400 "Failed to initialize samplers".
# Without the prefix the first token is `<` and the grammar runs.
def drop_space_prefix(writer: gguf.GGUFWriter) -> None:
    writer.add_add_space_prefix(False)


def write_model(
    source: Path,
    path: Path,
    name: str,
    dim: int,
    layers: int,
    heads: int,
    ffn: int,
    context: int,
    seed: int,
) -> None:
    reader = gguf.GGUFReader(source / VOCAB_FILE)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(name)
    writer.add_context_length(context)
    writer.add_embedding_length(dim)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(dim // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = copy_tokenizer(reader, writer)
    add_fim_tokens(reader, writer)
    drop_space_prefix(writer)
    writer.add_vocab_size(n_vocab)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # Small weights keep the activations finite through the layers.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(dim, dtype=np.float32)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, dim))
    for layer in range(layers):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", norm())
        writer.add_tensor(f"{prefix}.attn_q.weight", matrix(dim, dim))
        writer.add_tensor(f"{prefix}.attn_k.weight", matrix(dim, dim))
        writer.add_tensor(f"{prefix}.attn_v.weight", matrix(dim, dim))
        writer.add_tensor(f"{prefix}.attn_output.weight", matrix(dim, dim))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", norm())
        writer.add_tensor(f"{prefix}.ffn_gate.weight", matrix(ffn, dim))
        writer.add_tensor(f"{prefix}.ffn_up.weight", matrix(ffn, dim))
        writer.add_tensor(f"{prefix}.ffn_down.weight", matrix(dim, ffn))
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor("output.weight", matrix(n_vocab, dim))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source = Path(sys.argv[1])
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    write_model(source, out / "tiny.gguf", "oqp-tiny", 384, 6, 6, 1024, 8192, seed=11434)
    write_model(source, out / "tiny-embed.gguf", "oqp-tiny-embed", 128, 2, 2, 256, 2048, seed=34)


if __name__ == "__main__":
    main()
