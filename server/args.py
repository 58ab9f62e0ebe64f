"""The server's own options (everything else `radixlm serve` takes is an Engine option). Each field's
help, choices and aliases are the one source of its command-line flag (cli.py) and its docs row."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.core.runtime.options import LOG_LEVELS, option


@dataclass
class ServerArgs:
    host: str = option("127.0.0.1", "interface to listen on (loopback unless you say otherwise)")
    port: int = option(30000, "port to listen on; 0 picks a free one (the log line tells which)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every endpoint but /health* "
                                 "and /metrics")
    allowed_origins: list[str] | None = option(None, "origins allowed by CORS (browsers), e.g. '*' or "
                                               "https://app.example.com; default: no CORS headers")
    ssl_keyfile: str | None = option(None, "TLS private key file (serve HTTPS; needs --ssl-certfile)")
    ssl_certfile: str | None = option(None, "TLS certificate file (serve HTTPS; needs --ssl-keyfile)")
    root_path: str = option("", "URL prefix a reverse proxy strips before forwarding (ASGI root_path)")
    log_requests: bool = option(False, "log one summary line per request: id, prompt/cached/completion tokens, "
                                "TTFT, latency, finish reason")
    log_interval: float = option(10.0, "seconds between log lines with running/queued requests, batch tokens, "
                                 "cache hit rate and generation throughput (logged only while busy); 0: never")
    uvicorn_log_level: str = option("warning", "level of uvicorn's own log", choices=LOG_LEVELS)
    max_stored_responses: int = option(1024, "responses of /v1/responses kept in memory for "
                                       "previous_response_id (oldest dropped first)")
    drain_timeout: float = option(30.0, "seconds, after SIGTERM, that requests in flight get to finish while new ones "
                                  "get 503 (draining); then the rest end with a 503 or a final error event and the "
                                  "server exits 0 (a second signal exits at once)")
