"""radixlm.adapters.dspy: `SGLangLM`, a dspy.LM on radixlm, whose calls run as fork/join programs
(program.py) with replies constrained to the calling DSPy adapter's format (formats.py). See docs/dspy.md."""

from radixlm.adapters.dspy.formats import chat_regex, format_for_call, json_schema
from radixlm.adapters.dspy.lm import SGLangLM
from radixlm.adapters.dspy.program import LMCall, ProgramNode, build_tree, run_program

__all__ = ["SGLangLM", "chat_regex", "json_schema", "format_for_call", "LMCall", "ProgramNode", "build_tree",
           "run_program"]
