"""Chat templates as role prefixes and suffixes, the form the interpreter needs to append a role's
text piece by piece (`with s.user(): s += ...`).

Local models get theirs from the tokenizer's own (Jinja) chat template, recovered by rendering a few
conversations with sentinel contents. API models, whose template is hidden, use a named one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    # Prefixes that differ when the role opens the conversation (a BOS, a built-in system block).
    first_prefix: dict[str, str] = field(default_factory=dict)
    stop_str: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    image_token: str = "<image>"
    video_token: str = "<video>"

    def get_prefix_and_suffix(self, role: str, history: list[dict[str, Any]]) -> tuple[str, str]:
        prefix, suffix = self.role_prefix_and_suffix.get(role, ("", ""))
        if not history and role in self.first_prefix:
            prefix = self.first_prefix[role]
        return prefix, suffix

    def get_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The text of a whole conversation."""
        text = ""
        for i, message in enumerate(messages):
            prefix, suffix = self.get_prefix_and_suffix(message["role"], messages[:i])
            text += prefix + message["content"] + suffix
        return text


_REGISTRY: dict[str, ChatTemplate] = {}


def register_chat_template(template: ChatTemplate) -> None:
    _REGISTRY[template.name] = template


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(_REGISTRY)}") from None


def get_chat_template_by_model_path(model_path: str | None) -> ChatTemplate:
    """A named template guessed from a model name (API models); 'default' when nothing matches."""
    path = (model_path or "").lower()
    if "qwen" in path:
        return get_chat_template("qwen")
    if "llama-3" in path or "llama3" in path:
        return get_chat_template("llama-3-instruct")
    if "claude" in path:
        return get_chat_template("claude")
    return get_chat_template("default")


_IM = ("<|im_start|>system\n", "<|im_end|>\n"), ("<|im_start|>user\n", "<|im_end|>\n"), \
      ("<|im_start|>assistant\n", "<|im_end|>\n")
_L3 = "<|start_header_id|>{}<|end_header_id|>\n\n"

for _template in (
    ChatTemplate("default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"),
                             "assistant": ("ASSISTANT:", "\n")}),
    ChatTemplate("chatml", dict(zip(("system", "user", "assistant"), _IM)), stop_str=("<|im_end|>",)),
    ChatTemplate("qwen", dict(zip(("system", "user", "assistant"), _IM)),
                 default_system_prompt="You are a helpful assistant.", stop_str=("<|im_end|>",)),
    ChatTemplate("llama-3-instruct", {r: (_L3.format(r), "<|eot_id|>") for r in ("system", "user", "assistant")},
                 stop_str=("<|eot_id|>",)),
    ChatTemplate("claude", {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")}),
):
    register_chat_template(_template)


def _between(text: str, start: str, end: str | None) -> str:
    """The text after the first `start` and before the following `end` (or the end of text)."""
    i = text.index(start) + len(start)
    return text[i:] if end is None else text[i:text.index(end, i)]


def chat_template_from_tokenizer(tokenizer: Any, name: str = "tokenizer") -> ChatTemplate | None:
    """Role prefixes/suffixes recovered from a Hugging Face tokenizer's chat template, or None when
    the tokenizer has none or its template cannot be cut into per-role pieces."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    sys_, usr, usr2, ast = "\x01SYS\x01", "\x01USR\x01", "\x01USR2\x01", "\x01AST\x01"

    def render(messages: list[tuple[str, str]], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             tokenize=False, add_generation_prompt=generation_prompt)

    try:
        only_user = render([("user", usr)])
        with_prompt = render([("user", usr)], generation_prompt=True)
        user_assistant = render([("user", usr), ("assistant", ast)])
        three = render([("user", usr), ("assistant", ast), ("user", usr2)])
    except Exception:
        return None
    if not with_prompt.startswith(only_user):
        return None
    first_user_prefix = only_user[:only_user.index(usr)]
    user_suffix = _between(only_user, usr, None)
    assistant_prefix = with_prompt[len(only_user):]
    assistant_suffix = _between(user_assistant, ast, None)
    between_turns = _between(three, ast, usr2)
    if (_between(user_assistant, usr, ast) != user_suffix + assistant_prefix
            or not between_turns.startswith(assistant_suffix)):
        return None
    user_prefix = between_turns[len(assistant_suffix):]

    try:
        with_system = render([("system", sys_), ("user", usr)])
        system_prefix = with_system[:with_system.index(sys_)]
        system_and_user = _between(with_system, sys_, usr)
        system_suffix = system_and_user[:len(system_and_user) - len(user_prefix)] \
            if system_and_user.endswith(user_prefix) else system_and_user
    except Exception:  # templates that reject a system message: keep its text as a plain block
        system_prefix, system_suffix = "", "\n\n"

    # The engine tokenizes prompts with the tokenizer's own special tokens (a BOS); a template that
    # also writes the BOS as text would double it.
    bos = getattr(tokenizer, "bos_token", None)
    if bos and _adds_bos(tokenizer):
        first_user_prefix = first_user_prefix.removeprefix(bos)
        system_prefix = system_prefix.removeprefix(bos)

    # What a conversation starts with before its first role (a BOS): only the first message has it.
    start = first_user_prefix[:len(first_user_prefix) - len(user_prefix)] \
        if user_prefix and first_user_prefix.endswith(user_prefix) else ""
    later_system_prefix = system_prefix.removeprefix(start) if start else system_prefix

    end_marker = assistant_suffix.strip()
    stop_ids: tuple[int, ...] = ()
    if end_marker:
        ids = tokenizer.encode(end_marker, add_special_tokens=False)
        stop_ids = tuple(ids) if len(ids) == 1 else ()
    return ChatTemplate(
        name=name,
        role_prefix_and_suffix={"system": (later_system_prefix, system_suffix),
                                "user": (user_prefix, user_suffix),
                                "assistant": (assistant_prefix, assistant_suffix)},
        first_prefix={"user": first_user_prefix, "system": system_prefix},
        stop_str=(end_marker,) if end_marker else (),
        stop_token_ids=stop_ids,
    )


def _adds_bos(tokenizer: Any) -> bool:
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False
    ids = tokenizer("a").input_ids
    return bool(ids) and ids[0] == bos_id
