"""The language (the paper's frontend): the program IR (ir.py), tracing (tracer.py), the interpreter
that runs a program's streams (interpreter.py, state.py), the tracing compiler (compiler.py),
`@function` (function.py), and the backends a program's calls go to (backends/). It reaches the
runtime only through `radixlm.Engine`."""
