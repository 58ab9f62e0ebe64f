"""A DSPy program on radixlm: a few-shot ChainOfThought ticket triager, run on one ticket and then as
a batch whose shared instructions and demos are computed once.

    python examples/dspy_program.py                          # the embedded SmolLM2-135M-Instruct
    python examples/dspy_program.py --model-path PATH_OR_HUB_ID

Replies are kept parseable by constrained decoding to DSPy's own ChatAdapter format; the team is one of
the Literal's values by construction. A 135M model triages about half of the tickets right (one demo
per team helps it most); a larger model does better with the same program.
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
    dspy.Example(ticket="I forgot my password.", reasoning="Passwords and logins belong to the account team.",
                 team="accounts", reply="We have sent you a link to reset your password."),
]

TICKETS = ["My invoice shows the wrong amount.", "I cannot log in after changing my email.",
           "The page goes blank when I click save.", "Please close my account."]


def main(argv: list[str] | None = None, engine: Any = None) -> list[dspy.Prediction]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder, .gguf file or hub id (default: "
                                                          "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-field-chars", type=int, default=None, help="bound each free-text field")
    args = parser.parse_args(argv)
    owned = engine is None
    if owned:
        engine = radixlm.Engine(args.model_path)
    lm = SGLangLM(engine=engine, temperature=0, max_tokens=256, max_field_chars=args.max_field_chars)
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
