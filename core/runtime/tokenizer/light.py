"""A fast tokenizer read straight from a saved `tokenizer.json` by the `tokenizers` library, with the
interface of transformers' fast tokenizer, without importing transformers (a CPU second and more of the
default model's start-up, against 0.4 s for this).

It serves a folder that radixlm saved from a transformers tokenizer (core.runtime.tokenizer.loader: the GGUF
tokenizer cache), beside `radixlm_tokenizer.json`, a manifest of what transformers resolved there: the
special tokens, the chat template. So the Rust tokenizer is the very one transformers held, and encode,
decode, the vocabulary and plain-JSON chat templates are answered here, equal to transformers'
(tests/test_tokenizer_light.py checks them against it); every other call and attribute (batched or
padded encoding, tensors, assistant masks, ...) goes to transformers' tokenizer of the same folder,
loaded on first use.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

MANIFEST = "radixlm_tokenizer.json"
# apply_chat_template's arguments that send a call to transformers when set (any other keyword argument
# is a template variable, as there).
_TRANSFORMERS_CHAT_ARGS = ("continue_final_message", "sanitize_control_tokens", "padding", "truncation",
                           "max_length", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers copies these into each other
# Attributes of the light tokenizer itself: setting any other hands the tokenizer over to transformers'.
_OWN_FIELDS = {"name_or_path", "backend_tokenizer", "chat_template"}


def write_manifest(tok: Any, folder: str) -> bool:
    """Saves beside transformers' own files what LightTokenizer needs of the transformers tokenizer `tok`,
    when LightTokenizer reproduces it: a fast tokenizer that decodes without space clean-up, encodes
    special tokens as such, and has one chat template (or none). Returns whether it wrote the manifest."""
    template = getattr(tok, "chat_template", None)
    if (not getattr(tok, "is_fast", False) or getattr(tok, "clean_up_tokenization_spaces", True)
            or getattr(tok, "split_special_tokens", True) or not (template is None or isinstance(template, str))):
        return False
    manifest = {"special_tokens_map": tok.special_tokens_map, "all_special_ids": list(tok.all_special_ids),
                "chat_template": template}
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return True


def checkpoint_manifest(folder: str) -> dict[str, Any]:
    """The manifest of an HF checkpoint folder's tokenizer, read from its tokenizer_config.json (special
    tokens, chat template; a chat_template.jinja beside it wins, as in transformers) without transformers.
    The special ids are those of tokenizer.json's special added tokens. ValueError when there is no
    tokenizer.json. Encoding with it is transformers' wherever transformers uses tokenizer.json as it is
    (PreTrainedTokenizerFast; classes that rebuild the tokenizer from its vocabulary may differ)."""
    def read(name: str) -> Any:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return f.read() if name.endswith(".jinja") else json.load(f)

    backend = read("tokenizer.json")
    if backend is None:
        raise ValueError(f"{folder} has no tokenizer.json")
    config = {**(read("special_tokens_map.json") or {}), **(read("tokenizer_config.json") or {})}
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    special = {n: t.get("content") if isinstance(t, dict) else t for n in names if (t := config.get(n))}
    template = read("chat_template.jinja") or config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    ids = [t["id"] for t in backend.get("added_tokens", []) if t.get("special")]
    return {"special_tokens_map": special, "all_special_ids": ids, "chat_template": template}


class Encoding(dict):
    """What calling the tokenizer returns, as transformers' BatchEncoding: input_ids and attention_mask,
    by key or by attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _or_transformers(method: Callable) -> Callable:
    """The method, or transformers' of the same name once the tokenizer has been handed over."""
    @functools.wraps(method)
    def wrapper(self: "LightTokenizer", *args: Any, **kwargs: Any) -> Any:
        if self._handed_over:
            return getattr(self._hf(), method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)
    return wrapper


def _read_only(name: str, getter: Callable[[Any], Any]) -> property:
    """A property answered here, or by transformers' tokenizer once handed over."""
    return property(lambda self: getattr(self._hf(), name) if self._handed_over else getter(self))


class LightTokenizer:
    """Setting any attribute other than `chat_template` (e.g. `pad_token`, `padding_side`,
    `add_bos_token`) sets it on transformers' tokenizer and hands every later call over to it: what such
    a change does to encoding is transformers' to know."""

    _handed_over = False

    def __init__(self, folder: str, manifest: dict[str, Any] | None = None, transformers_ok: bool = True) -> None:
        """The tokenizer saved in `folder` (tokenizer.json and the manifest, read from the folder unless
        given; OSError/ValueError if unreadable). With transformers_ok=False a call this class does not
        answer itself raises NotImplementedError instead of importing transformers (and torch)."""
        if manifest is None:
            with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
        self.name_or_path = folder
        self._transformers_ok = transformers_ok
        try:
            self.backend_tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception for a file it cannot parse
            raise ValueError(f"unreadable tokenizer.json in {folder}: {e}") from e
        self._special_tokens_map: dict[str, Any] = manifest["special_tokens_map"]
        self._all_special_ids: list[int] = manifest["all_special_ids"]
        self.chat_template: str | None = manifest["chat_template"]
        self._hf_tokenizer: Any = None
        self._hf_lock = threading.Lock()
        # jinja2's import (0.1 to 0.2 s) on the thread that loads the tokenizer, beside the weights' load,
        # rather than with the engine's modules, before it
        from radixlm.core.runtime.tokenizer import jinja_chat

        self._jinja = jinja_chat

    # ---- transformers' tokenizer, for everything not answered here -------------------------------

    def _hf(self) -> Any:
        if not self._transformers_ok:
            raise NotImplementedError("this call needs transformers' tokenizer, which this process does not load")
        with self._hf_lock:
            if self._hf_tokenizer is None:
                from transformers import PreTrainedTokenizerFast

                self._hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(self.name_or_path)
            self._hf_tokenizer.chat_template = self.chat_template  # as set here since (--chat-template)
            return self._hf_tokenizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not looked up on transformers' (copies, pickling, our own fields)
            raise AttributeError(name)
        return getattr(self._hf(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in _OWN_FIELDS:
            object.__setattr__(self, name, value)
            return
        hf = self._hf()
        setattr(hf, name, value)
        self._handed_over = True
        self.backend_tokenizer = hf.backend_tokenizer  # the fast path encodes and decodes with it

    # ---- special tokens ---------------------------------------------------------------------------

    def _special(self, kind: str) -> str | None:
        return self._special_tokens_map.get(f"{kind}_token")

    def _special_id(self, kind: str) -> int | None:
        token = self._special(kind)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token = _read_only("bos_token", lambda self: self._special("bos"))
    eos_token = _read_only("eos_token", lambda self: self._special("eos"))
    unk_token = _read_only("unk_token", lambda self: self._special("unk"))
    pad_token = _read_only("pad_token", lambda self: self._special("pad"))
    bos_token_id = _read_only("bos_token_id", lambda self: self._special_id("bos"))
    eos_token_id = _read_only("eos_token_id", lambda self: self._special_id("eos"))
    unk_token_id = _read_only("unk_token_id", lambda self: self._special_id("unk"))
    pad_token_id = _read_only("pad_token_id", lambda self: self._special_id("pad"))
    special_tokens_map = _read_only("special_tokens_map", lambda self: dict(self._special_tokens_map))
    all_special_ids = _read_only("all_special_ids", lambda self: list(self._all_special_ids))
    all_special_tokens = _read_only("all_special_tokens", lambda self: [
        self.backend_tokenizer.id_to_token(i) for i in self._all_special_ids])
    is_fast = _read_only("is_fast", lambda self: True)
    clean_up_tokenization_spaces = _read_only("clean_up_tokenization_spaces", lambda self: False)

    # ---- vocabulary -------------------------------------------------------------------------------

    @_or_transformers
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    vocab_size = _read_only("vocab_size", lambda self: self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    @_or_transformers
    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @_or_transformers
    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Each token's id; a token not in the vocabulary gets the unknown token's id (None without one)."""
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    @_or_transformers
    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        if skip_special_tokens:
            return self._hf().convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    # ---- encode / decode --------------------------------------------------------------------------

    @_or_transformers
    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):  # batches, pairs, padding, tensors: transformers'
            return self._hf()(text, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids))

    @_or_transformers
    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self._hf().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @_or_transformers
    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if isinstance(ids, int):
            ids = [ids]
        if kwargs or not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
            return self._hf().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)  # tensors, ...
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat template ----------------------------------------------------------------------------

    @_or_transformers
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """transformers' apply_chat_template: rendered here for one conversation of plain JSON messages
        with plain template variables; by transformers otherwise."""
        if not self._renders_here(conversation, kwargs):
            return self._hf().apply_chat_template(conversation, **kwargs)
        for name in _TRANSFORMERS_CHAT_ARGS:  # unset (False, None): as if not given
            kwargs.pop(name, None)
        template = kwargs.pop("chat_template", None) or self.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template and none was passed (chat_template=...)")
        tokenize, return_dict = kwargs.pop("tokenize", True), kwargs.pop("return_dict", True)
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for document in kwargs.get("documents") or []:
            if not isinstance(document, dict):
                raise TypeError("documents should be a list of dicts with 'title' and 'text' keys")
        variables = {"tools": None, "documents": None, "add_generation_prompt": False,
                     **self._special_tokens_map, **kwargs}
        text = self._jinja.render(template, conversation, **variables)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    def _renders_here(self, conversation: Any, kwargs: dict[str, Any]) -> bool:
        template = kwargs.get("chat_template") or self.chat_template or ""
        return (type(conversation) is list and all(type(m) is dict for m in conversation)
                and not any(m.get(f) is not None for m in conversation for f in _REASONING_FIELDS)
                and self._jinja.is_plain(conversation) and not any(kwargs.get(a) for a in _TRANSFORMERS_CHAT_ARGS)
                and all(self._jinja.is_plain(v) for v in kwargs.values())
                and not re.search(r"\{%-?\s*generation\s*-?%\}", template))

