"""A LangChain chain on radixlm: a shared system prompt, run as a batch and as parallel branches.

    python examples/langchain_chain.py                          # the embedded SmolLM2-135M-Instruct
    python examples/langchain_chain.py --model-path PATH_OR_HUB_ID
    python examples/langchain_chain.py --base-url http://127.0.0.1:30000   # a running `radixlm serve`

The chain is plain LangChain (`prompt | model | parser`); only the model is radixlm's ChatSGLang. Its
batch is one shared-prefix program (the system prompt is computed once, see the cached tokens), and
`to_program` runs a RunnableParallel of two such chains as one fork/join program.
"""

from __future__ import annotations

import argparse
from typing import Any

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableParallel

from radixlm.adapters.langchain import ChatSGLang, to_program

SYSTEM = ("You are the support assistant of a database company. Answer in one short sentence, "
          "name the product feature involved, and never invent version numbers.")

QUESTIONS = ["How do I back up a table?", "Why is my query slow?", "Can I rename a column?"]


ASK = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
RATE = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "Rate this question from 1 to 5: {question}")])


def main(argv: list[str] | None = None, engine: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--base-url", default=None, help="a radixlm server instead of an in-process engine")
    args = parser.parse_args(argv)
    if engine is not None:
        target: dict[str, Any] = {"engine": engine}
    elif args.base_url:
        target = {"base_url": args.base_url}
    else:
        target = {"model_path": args.model_path}
    llm = ChatSGLang(**target, temperature=0, max_tokens=24)

    # 1. A batch: the system prompt is prefilled once, every call reads it from the radix cache.
    replies = (ASK | llm).batch([{"question": q} for q in QUESTIONS])
    for question, reply in zip(QUESTIONS, replies):
        usage = reply.usage_metadata
        print(f"{question} -> {reply.content!r} "
              f"({usage['input_token_details']['cache_read']} of {usage['input_tokens']} prompt tokens cached)")

    # 2. Two chains over one input, as one fork/join program.
    both = RunnableParallel(answer=ASK | llm | StrOutputParser(), rating=RATE | llm | StrOutputParser())
    program = to_program(both)
    print(program)
    parallel = program.invoke({"question": QUESTIONS[0]})
    print(parallel)
    return {"replies": replies, "program": program, "parallel": parallel}


if __name__ == "__main__":
    main()
