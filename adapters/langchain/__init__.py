"""radixlm.adapters.langchain: LangChain on radixlm.

`ChatSGLang` is a langchain-core chat model served by radixlm (in-process or through `radixlm serve`);
`to_program(runnable)` translates a chain into a radixlm program (shared prefixes computed once,
RunnableParallel branches as fork/join), shows it and runs it.
"""

from radixlm.adapters.langchain.chat_model import ChatSGLang
from radixlm.adapters.langchain.translate import LangChainProgram, to_program

__all__ = ["ChatSGLang", "LangChainProgram", "to_program"]
