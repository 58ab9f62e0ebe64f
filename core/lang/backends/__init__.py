"""Where a program's calls go: the in-process Engine (local_engine.py), a server's native /generate
(runtime_endpoint.py), an OpenAI-style API with API speculative execution (openai_backend.py,
speculative.py); base.py says what a backend answers, resolve.py which backend a program runs on."""
