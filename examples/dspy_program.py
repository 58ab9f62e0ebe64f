"""A DSPy program on radixlm: a few-shot ChainOfThought ticket triager, run on one ticket and then as
a batch whose shared instructions and demos are computed once.

    python examples/dspy_program.py                          # the embedded tiny model (random weights:
                                                             # the text is noise, the mechanics are real)
    python examples/dspy_program.py --model-path /path/to/hf-model

With the random-weight model, replies are kept parseable by constrained decoding to DSPy's own
ChatAdapter format, and each free-text field is bounded to --max-field-chars characters.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # DSPy's LiteLLM: no price-list download

import dspy  # noqa: E402

import radixlm  # noqa: E402
from radixlm.adapters.dspy import SGLangLM  # noqa: E402


class Triage(dspy.Signature):
    """Read a customer support ticket, decide which team handles it and draft a one-line reply."""

    ticket: str = dspy.InputField()
    team: Literal["billing", "bugs", "accounts"] = dspy.OutputField()
    reply: str = dspy.OutputField(desc="one polite sentence")


DEMOS = [
    dspy.Example(ticket="I was charged twice this month.", reasoning="A duplicate charge is a billing issue.",
                 team="billing", reply="Sorry about that, we are refunding the second charge."),
    dspy.Example(ticket="The export button crashes the app.", reasoning="A crash is a software defect.",
                 team="bugs", reply="Thanks for the report, our engineers are on it."),
]

TICKETS = ["My invoice shows the wrong amount.", "I cannot log in after changing my email.",
           "The page goes blank when I click save.", "Please close my account."]


def main(argv: list[str] | None = None, engine: Any = None) -> list[dspy.Prediction]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="HF checkpoint directory (default: embedded tiny model)")
    parser.add_argument("--max-field-chars", type=int, default=None,
                        help="bound each free-text field (default: 32 on the embedded model, none otherwise)")
    args = parser.parse_args(argv)
    owned = engine is None
    if owned:
        engine = radixlm.Engine(args.model_path)
    bound = args.max_field_chars if args.max_field_chars is not None else (32 if args.model_path is None else None)
    lm = SGLangLM(engine=engine, temperature=0, max_tokens=256, max_field_chars=bound)
    triage = dspy.ChainOfThought(Triage)
    triage.predict.demos = DEMOS
    try:
        with dspy.context(lm=lm, adapter=dspy.ChatAdapter(), track_usage=True):
            first = triage(ticket="I was billed after cancelling.")
            print(f"team={first.team!r} reply={first.reply!r}")
            results = triage.batch([dspy.Example(ticket=t).with_inputs("ticket") for t in TICKETS],
                                   num_threads=len(TICKETS), disable_progress_bar=True)
        for ticket, prediction in zip(TICKETS, results):
            usage = prediction.get_lm_usage()[lm.model]
            print(f"{ticket} -> {prediction.team} ({usage['prompt_tokens_details']['cached_tokens']} of "
                  f"{usage['prompt_tokens']} prompt tokens cached)")
        print("the batch's last program:\n" + (lm.last_program or ""))
        return [first, *results]
    finally:
        if owned:
            engine.shutdown()


if __name__ == "__main__":
    main()
