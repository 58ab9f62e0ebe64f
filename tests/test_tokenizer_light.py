"""The default model's tokenizer as radixlm reads it back from its cache without transformers
(core.runtime.tokenizer.light) against transformers' tokenizer of the same files, the oracle: tokens, special
tokens, vocabulary, decoding and the chat template, rendered here and there; the calls it leaves to
transformers give transformers' answers; and a default engine never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import PreTrainedTokenizerFast

from radixlm.core.runtime.models.default_model import default_model_path
from radixlm.core.runtime.tokenizer.light import MANIFEST, LightTokenizer
from radixlm.core.runtime.tokenizer.loader import load_gguf_tokenizer

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>\n", "  spaces  \n\n tabs\t", "héllo 日本語 🤖 naïve",
         "", "<|endoftext|><repo_name>x<file_sep>", "def f(x):\n    return x ** 2  # ok", "1234567 + 89 = ?"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? <|im_end|>"},
            {"role": "assistant", "content": "4", "tool_calls": None}, {"role": "user", "content": "ünï ☃"}]
# A tool-aware template using what transformers' environment adds: tojson with its options, namespace,
# raise_exception, loop controls, the special tokens and a caller's variable.
TOOL_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>{% endif %}"
    "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if loop.index > 9 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ ' /think' if enable_thinking else '' }}\n{% endif %}"
    "[{{ ns.n }}]{{ dict(a=1) | tojson }}"
)
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather (°C) in <city> & \"quotes\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the light tokenizer, transformers' tokenizer of the same cache folder)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    light = load_gguf_tokenizer(default_model_path())
    mp.undo()
    assert isinstance(light, LightTokenizer)
    return light, PreTrainedTokenizerFast.from_pretrained(light.name_or_path)


def test_tokens_equal_transformers(pair):
    light, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
            assert light(text, add_special_tokens=special) == dict(hf(text, add_special_tokens=special))
        ids = hf.encode(text)
        assert light(text).input_ids == ids
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert light.decode(list(range(0, 600, 7))) == hf.decode(list(range(0, 600, 7)))
    assert light.decode(2) == hf.decode(2)


def test_special_tokens_and_vocabulary_equal_transformers(pair):
    light, hf = pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map", "vocab_size",
                 "chat_template", "is_fast", "clean_up_tokenization_spaces"):
        assert getattr(light, name) == getattr(hf, name), name
    assert light.eos_token_id == 2 and light.eos_token == "<|im_end|>"  # SmolLM2's ChatML end of turn
    assert len(light) == len(hf) == 49152 and light.get_vocab() == hf.get_vocab()
    assert light.convert_ids_to_tokens([0, 1, 2, 300, 49151]) == hf.convert_ids_to_tokens([0, 1, 2, 300, 49151])
    assert light.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    tokens = ["<|im_end|>", "Hello", "not-a-token-xyz"]
    assert light.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert light.convert_tokens_to_ids("<repo_name>") == hf.convert_tokens_to_ids("<repo_name>") == 3


@pytest.mark.parametrize("kwargs", [
    {"tokenize": False}, {"tokenize": False, "add_generation_prompt": True}, {},
    {"add_generation_prompt": True, "return_dict": False}, {"tokenize": True, "return_dict": True},
    {"tokenize": False, "chat_template": TOOL_TEMPLATE, "tools": TOOLS, "add_generation_prompt": True,
     "enable_thinking": True},
    {"tokenize": False, "chat_template": TOOL_TEMPLATE, "tools": [], "documents": [{"title": "t", "text": "x"}]},
    {"return_dict": False, "chat_template": TOOL_TEMPLATE, "add_generation_prompt": True},
], ids=lambda k: ",".join(f"{a}" for a in k) or "defaults")
def test_chat_template_equals_transformers(pair, kwargs):
    light, hf = pair
    got, want = light.apply_chat_template(MESSAGES, **kwargs), hf.apply_chat_template(MESSAGES, **kwargs)
    assert (dict(got) == dict(want)) if isinstance(want, dict) else (got == want)
    assert light._hf_tokenizer is None  # rendered here, not passed on to transformers


def test_template_errors_are_transformers_errors(pair):
    import jinja2

    light, hf = pair
    for tok in (light, hf):
        with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
            tok.apply_chat_template([{"role": "bad", "content": "x"}], chat_template=TOOL_TEMPLATE, tokenize=False)
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(MESSAGES, chat_template="{% set ns = namespace(_x=1) %}", tokenize=False)
        with pytest.raises(ValueError):
            tok.apply_chat_template([], tokenize=False)


def test_other_calls_go_to_transformers(pair):
    """What the light tokenizer does not answer itself (batches, tensors, continuing a message, message
    objects, attributes it lacks) comes from transformers' tokenizer of the same folder, loaded then."""
    light, hf = pair
    fresh = LightTokenizer(light.name_or_path)
    assert fresh._hf_tokenizer is None
    assert fresh.batch_decode([[1, 2], [3]]) == hf.batch_decode([[1, 2], [3]])
    assert fresh._hf_tokenizer is not None
    assert dict(fresh(["a b", "c"])) == dict(hf(["a b", "c"]))
    assert fresh(TEXTS[0], return_tensors="pt")["input_ids"].tolist() == [hf.encode(TEXTS[0])]
    continued = [*MESSAGES[:2], {"role": "assistant", "content": "The answer is"}]
    assert (fresh.apply_chat_template(continued, continue_final_message=True, tokenize=False)
            == hf.apply_chat_template(continued, continue_final_message=True, tokenize=False))
    assert (fresh.apply_chat_template([MESSAGES, MESSAGES[:1]], tokenize=False)
            == hf.apply_chat_template([MESSAGES, MESSAGES[:1]], tokenize=False))
    fresh.chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"  # --chat-template
    rendered = fresh.apply_chat_template([MESSAGES], tokenize=False)  # batched: by transformers
    assert rendered == ["[Be brief.][What is 2+2? <|im_end|>][4][ünï ☃]"]
    assert fresh.model_max_length == hf.model_max_length
    with pytest.raises(AttributeError):
        fresh.no_such_attribute


def test_setting_an_attribute_hands_over_to_transformers(pair):
    """After `pad_token = ...` or `add_bos_token = True` (which changes how transformers encodes), every
    answer is transformers' own, as if the user held transformers' tokenizer."""
    light, _ = pair
    fresh = LightTokenizer(light.name_or_path)
    hf = PreTrainedTokenizerFast.from_pretrained(light.name_or_path)
    for tok in (fresh, hf):
        tok.pad_token = "<repo_name>"
        tok.add_bos_token = True
    assert fresh.pad_token == hf.pad_token == "<repo_name>" and fresh.pad_token_id == hf.pad_token_id == 3
    assert fresh.encode(TEXTS[0]) == hf.encode(TEXTS[0]) and fresh.encode(TEXTS[0])[0] == hf.bos_token_id
    assert fresh(TEXTS[0]) == dict(hf(TEXTS[0])) and fresh.special_tokens_map == hf.special_tokens_map
    assert fresh.backend_tokenizer.encode(TEXTS[0]).ids == hf.encode(TEXTS[0])  # the fast path's backend too
    assert fresh.apply_chat_template(MESSAGES, return_dict=False) == hf.apply_chat_template(MESSAGES, return_dict=False)
    fresh.chat_template = hf.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert fresh.apply_chat_template(MESSAGES, tokenize=False) == hf.apply_chat_template(MESSAGES, tokenize=False)


def test_a_damaged_manifest_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    first = load_gguf_tokenizer(default_model_path())
    manifest = f"{first.name_or_path}/{MANIFEST}"
    with open(manifest, "w") as f:
        f.write("{ not json")
    again = load_gguf_tokenizer(default_model_path())
    assert isinstance(again, LightTokenizer) and again.encode(TEXTS[3]) == first.encode(TEXTS[3])
    with open(manifest) as f:
        assert json.load(f)["special_tokens_map"]["eos_token"] == "<|im_end|>"


def test_the_default_engine_never_imports_transformers():
    """Engine() and a chat request on the default model, in a fresh process, once the tokenizer cache is
    warm (the fixture's build went to another folder: a first process warms the user's own)."""
    warm = "from radixlm.core.runtime.models.default_model import default_model_path as p\n" \
           "from radixlm.core.runtime.tokenizer.loader import load_gguf_tokenizer\nload_gguf_tokenizer(p())\n"
    subprocess.run([sys.executable, "-c", warm], check=True, timeout=300)
    code = (
        "import sys, radixlm\n"
        "with radixlm.Engine(log_level='warning') as engine:\n"
        "    chat = engine.tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False,\n"
        "                                                add_generation_prompt=True)\n"
        "    engine.generate(chat, {'max_new_tokens': 2, 'temperature': 0})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'triton', 'safetensors')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
