"""Tiny checkpoints: the tokenizer, the random-weight models (checked with HF transformers and
safetensors as oracles) and the embedded default model."""

from __future__ import annotations

import json
import threading
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixlm.testing.checkpoints import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_checkpoint,
    build_tokenizer,
    tiny_model_path,
)

CHECKPOINTS = ["llama_ckpt", "llama_tied_ckpt", "qwen2_ckpt", "mistral_ckpt", "llama3_rope_ckpt", "sharded_ckpt"]


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return AutoTokenizer.from_pretrained(tokenizer_path)


def gpt2_byte_decoder() -> dict[str, int]:
    """The ByteLevel symbol -> byte table, written out from its definition (GPT-2): printable
    bytes stand for themselves, the others are shifted to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    for i, b in enumerate(shifted):
        table[chr(256 + i)] = b
    return table


# ---------------------------------------------------------------------------------------- tokenizer


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text_as_its_utf8_bytes(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Independent check: the tokens' byte-level symbols spell exactly the UTF-8 bytes of the text.
    byte_of = gpt2_byte_decoder()
    spelled = bytes(byte_of[ch] for token in tok.convert_ids_to_tokens(ids) for ch in token)
    assert spelled == text.encode("utf-8")


@pytest.fixture(scope="module")
def qwen2_tok(qwen2_ckpt):
    return AutoTokenizer.from_pretrained(qwen2_ckpt), Tokenizer.from_file(str(Path(qwen2_ckpt, "tokenizer.json")))


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_qwen2_tokenizer_agrees_with_its_file_and_normalizes_to_nfc(qwen2_tok, text):
    # transformers 5 rebuilds any qwen2 checkpoint's tokenizer as Qwen2Tokenizer; the saved
    # tokenizer.json must encode identically, and decoding gives the NFC form of the text.
    hf, raw = qwen2_tok
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert hf.decode(ids) == unicodedata.normalize("NFC", text)
    assert len(hf) == VOCAB_SIZE


def test_plain_encoding_adds_no_special_tokens(tok):
    assert tok.encode("Hello world") == tok.encode("Hello world", add_special_tokens=False)


def test_vocabulary_layout(tok, tokenizer_path):
    assert len(tok) == VOCAB_SIZE
    # The special tokens are the last ids, each a single token.
    specials = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert specials == list(range(VOCAB_SIZE - len(SPECIAL_TOKENS), VOCAB_SIZE))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    for token, token_id in zip(SPECIAL_TOKENS, specials):
        assert tok.encode(f"a{token}b", add_special_tokens=False)[1] == token_id
    # All 256 byte symbols are in the vocabulary, and merges make common words single tokens.
    vocab = tok.get_vocab()
    assert set(gpt2_byte_decoder()) <= set(vocab)
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    assert tok.is_fast


def test_tokenizer_build_is_deterministic(tmp_path, tokenizer_path):
    build_tokenizer(str(tmp_path / "again"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "again" / name).read_bytes() == Path(tokenizer_path, name).read_bytes()


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    ]
    body = (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == body
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        body + "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tok.encode(body + "<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[:2] == tok.convert_tokens_to_ids(["<|begin_of_text|>", "<|im_start|>"])


def test_chat_template_renders_tools_and_tool_calls(tok):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    text = tok.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools")
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(listed) == tool
    assert rest.count("<|im_start|>system") == 0  # the system message is rendered once, with the tools
    rendered_call = rest.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    assert json.loads(rendered_call) == call["function"]
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n" in rest
    assert text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------- checkpoints


def tensor_names(ckpt: str) -> set[str]:
    names: set[str] = set()
    for f in Path(ckpt).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st_file:
            names |= set(st_file.keys())
    return names


def load_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st_file:
            tensors.update({k: st_file.get_tensor(k) for k in st_file.keys()})
    return tensors


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_checkpoint_loads_in_transformers_and_greedy_depends_on_prompt(request, name):
    ckpt = request.getfixturevalue(name)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    sample = "Hi  there, 12345 caf\u00e9 cafe\u0301 \U0001f680<|im_start|>x"
    assert tok.encode(sample) == Tokenizer.from_file(str(Path(ckpt, "tokenizer.json"))).encode(sample).ids
    continuations = set()
    for prompt in ["The capital of France is", '{"name": "Alice", "age":', "def fibonacci(n):"]:
        inputs = tok(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        assert len(set(new)) > 2, f"{name} repeats itself: {new}"
        continuations.add(tuple(new))
    assert len(continuations) == 3, f"{name}: greedy output does not depend on the prompt"


def test_checkpoint_configs_and_files(llama_ckpt, llama_tied_ckpt, qwen2_ckpt, mistral_ckpt, llama3_rope_ckpt):
    def config(ckpt):
        return json.loads(Path(ckpt, "config.json").read_text())

    llama = config(llama_ckpt)
    assert (llama["model_type"], llama["hidden_size"], llama["intermediate_size"]) == ("llama", 64, 128)
    assert (llama["num_hidden_layers"], llama["num_attention_heads"], llama["num_key_value_heads"]) == (2, 4, 2)
    assert (llama["head_dim"], llama["max_position_embeddings"], llama["rope_theta"]) == (16, 2048, 500000.0)
    assert "lm_head.weight" in tensor_names(llama_ckpt)

    for tied in (llama_tied_ckpt, qwen2_ckpt):
        assert config(tied)["tie_word_embeddings"] is True
        assert "lm_head.weight" not in tensor_names(tied)

    qwen2 = config(qwen2_ckpt)
    assert (qwen2["model_type"], qwen2["rope_theta"]) == ("qwen2", 1000000.0)
    names = tensor_names(qwen2_ckpt)
    for proj in "qkv":
        assert f"model.layers.0.self_attn.{proj}_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names

    mistral = config(mistral_ckpt)
    assert (mistral["model_type"], mistral["num_attention_heads"], mistral["num_key_value_heads"]) == ("mistral", 8, 2)
    assert mistral["head_dim"] == 8
    with safe_open(str(Path(mistral_ckpt, "model.safetensors")), "pt") as f:
        assert tuple(f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()) == (2 * 8, 64)

    # Both the legacy rope keys and transformers 5's rope_parameters are written, and they agree.
    rope = config(llama3_rope_ckpt)
    assert rope["rope_scaling"]["rope_type"] == "llama3" and rope["rope_scaling"]["factor"] == 8.0
    assert rope["rope_parameters"] == {**rope["rope_scaling"], "rope_theta": rope["rope_theta"]}
    assert llama["rope_scaling"] is None and llama["rope_parameters"]["rope_type"] == "default"
    assert AutoModelForCausalLM.from_pretrained(llama3_rope_ckpt).config.rope_parameters["rope_type"] == "llama3"

    gen = json.loads(Path(llama_ckpt, "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    assert gen["bos_token_id"] == tok.bos_token_id
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|end_of_text|>", "<|im_end|>"])


def test_sharded_checkpoint_has_an_index_and_the_same_weights(sharded_ckpt, llama_ckpt):
    index = json.loads(Path(sharded_ckpt, "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {p.name for p in Path(sharded_ckpt).glob("*.safetensors")}
    for name, shard in index["weight_map"].items():
        with safe_open(str(Path(sharded_ckpt, shard)), "pt") as f:
            assert name in f.keys()
    sharded, single = load_tensors(sharded_ckpt), load_tensors(llama_ckpt)
    assert set(index["weight_map"]) == set(sharded) == set(single)
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_build_is_seeded_and_leaves_the_callers_rng_alone(tmp_path, llama_ckpt):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_checkpoint(str(tmp_path / "seed1"), "llama", seed=1)
    assert torch.equal(torch.rand(3), expected)
    a, b = load_tensors(llama_ckpt), load_tensors(str(tmp_path / "seed1"))
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_build_checkpoint_refuses_a_non_empty_destination(tmp_path):
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_checkpoint(str(dest), "llama")
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary dir left behind
    with pytest.raises(ValueError, match="unknown arch"):
        build_checkpoint(str(tmp_path / "gpt2"), "gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# ------------------------------------------------------------------------------------------- tiny model


def test_tiny_model_is_built_once_and_reused(tmp_path, monkeypatch, llama_ckpt):
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    path = tiny_model_path()
    assert path == str(tmp_path / "default-tiny-llama-v1")

    stamps = {p.name: p.stat().st_mtime_ns for p in Path(path).iterdir()}
    assert tiny_model_path() == path
    assert {p.name: p.stat().st_mtime_ns for p in Path(path).iterdir()} == stamps
    # The tiny model is exactly build_checkpoint(arch="llama", seed=0), untied.
    default, llama = load_tensors(path), load_tensors(llama_ckpt)
    assert set(default) == set(llama) and all(torch.equal(default[k], llama[k]) for k in llama)


def test_racing_builders_of_the_tiny_model_agree(tmp_path, monkeypatch):
    # Threads rather than processes, to keep the suite fast: all of them find the model missing
    # and build it, and all but one lose the final atomic rename, which is also what keeps
    # separate processes safe.
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    results: list[str] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(tiny_model_path())
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [str(tmp_path / "default-tiny-llama-v1")] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["default-tiny-llama-v1"]  # no temporary dir left
    AutoModelForCausalLM.from_pretrained(results[0])
