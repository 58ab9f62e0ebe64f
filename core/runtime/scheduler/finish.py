"""When a request ends: the finish decision after each new token, as a plain `Finish` value."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.core.runtime.request import Req


@dataclass(frozen=True)
class Finish:
    kind: str  # "stop", "length" or "abort"
    matched: str | int | None = None  # the stop string or token that ended it


def check_finish(req: Req, token: int, eos_token_ids: list[int], context_len: int) -> Finish | None:
    """Whether the request ends with `token` (already appended to its output): a stop token or EOS,
    a stop string in its text (looked for once min_new_tokens are out), max_new_tokens, or the context.
    Feeds the token to the request's detokenizer, which finds the stop strings."""
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return Finish("stop", token)
    matched = req.detok.add(token, check_stop=len(req.output_ids) >= p.min_new_tokens)
    if matched is not None:
        return Finish("stop", matched)
    if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= context_len:
        return Finish("length")
    return None
