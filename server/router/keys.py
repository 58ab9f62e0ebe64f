"""What the router routes on: a request's prompt as token ids, as the replicas will see it (their radix
caches key on token ids). With the replicas' tokenizer (given, or the one the first replica reports when
the router can load it) chat messages are rendered with its chat template and text is encoded; without
one, the key is the prompt text's UTF-8 bytes, which share prefixes where the token ids do.

The tokenizer is read by the `tokenizers` library alone (tokenizer.loader.load_light_tokenizer): the router
never imports transformers or torch, so that it runs on a small CPU machine.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from radixlm.core.chat.render import render_chat
from radixlm.core.runtime.tokenizer.loader import load_light_tokenizer

logger = logging.getLogger("radixlm.router")

# Bytes per token, roughly: a replica's KV pool in tokens holds about this many bytes of prompt text.
BYTES_PER_TOKEN = 4


class RoutingKeys:
    def __init__(self, tokenizer_path: str | None = None) -> None:
        self.tokenizer: Any = None
        self.tried = False  # a load was attempted (given path or a replica's)
        if tokenizer_path is not None:
            self.load(tokenizer_path, required=True)

    @property
    def units_per_token(self) -> int:
        """Key units per KV token: 1 for token ids, BYTES_PER_TOKEN for bytes."""
        return 1 if self.tokenizer is not None else BYTES_PER_TOKEN

    def load(self, path: str, required: bool = False) -> None:
        """Loads the tokenizer at path; a replica's path the router cannot read leaves keys on bytes."""
        self.tried = True
        try:
            self.tokenizer = load_light_tokenizer(path)
        except Exception as exc:  # any failure of a checkpoint loader: the fallback still routes well
            if required:
                raise ValueError(f"--tokenizer-path {path!r}: {exc}") from exc
            logger.warning("cannot load the replicas' tokenizer %r here (%s); routing on prompt bytes", path, exc)
            return
        logger.info("routing on token ids of the tokenizer at %s", path)

    def key(self, path: str, body: dict[str, Any]) -> list[int]:
        """The routing key of a request to `path` with JSON body `body` ([] when it has no prompt)."""
        try:
            if path == "/v1/chat/completions":
                return self._chat(body.get("messages"), body.get("tools"))
            if path == "/v1/responses":
                prompt = body.get("input")
                return self._chat(prompt, body.get("tools")) if isinstance(prompt, list) else self._text(prompt)
            if path == "/generate" and body.get("input_ids") is not None:
                return _first_ids(body["input_ids"])
            prompt = body.get("prompt") if path == "/v1/completions" else body.get("text")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return _first_ids(prompt)
            return self._text(prompt[0] if isinstance(prompt, list) and prompt else prompt)
        except Exception:  # a malformed body (the replica answers it with the right 400), or a template
            return []  # call only transformers renders: routed as if nothing were cached

    def _text(self, text: Any) -> list[int]:
        if isinstance(text, list):  # completions with token-id lists
            return _first_ids(text)
        if not isinstance(text, str):
            return []
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _chat(self, messages: Any, tools: Any) -> list[int]:
        if not isinstance(messages, list):
            return []
        turns = [{**m, "content": _plain_content(m.get("content"))} for m in messages if isinstance(m, dict)]
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return list(json.dumps(turns, ensure_ascii=False).encode())
        specs = [t.get("function", t) for t in tools] if isinstance(tools, list) else None
        return self._text(render_chat(self.tokenizer, turns, specs, add_generation_prompt=True))


def _first_ids(ids: list[Any]) -> list[int]:
    """A batch routes on its first prompt (a batch goes to one replica)."""
    first = ids[0] if ids and isinstance(ids[0], list) else ids
    return [int(t) for t in first]


def _plain_content(content: Any) -> Any:
    """A message's text: content parts joined (images are not part of the key)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content
