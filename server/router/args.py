"""The router's options. Each field's help, choices and aliases are the one source of its command-line
flag (`radixlm router --help`) and its row in docs/scale_out.md. Names follow SGLang's router
(sgl-router) where it has the option."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.core.runtime.options import LOG_LEVELS, option

POLICIES = ("cache_aware", "round_robin")


@dataclass
class RouterArgs:
    host: str = option("127.0.0.1", "interface to listen on (loopback unless you say otherwise)")
    port: int = option(30000, "port to listen on; 0 picks a free one (the log line tells which)")
    worker_urls: list[str] | None = option(None, "base URLs of `radixlm serve` replicas, e.g. "
                                           "http://10.0.0.2:30000")
    worker_urls_file: str | None = option(None, "a file of replica URLs, one a line ('#' starts a comment), "
                                          "read again every --discovery-interval-secs: replicas added to or "
                                          "removed from it join or leave")
    worker_dns: str | None = option(None, "NAME:PORT whose DNS addresses are the replicas (a Kubernetes headless "
                                    "Service), resolved again every --discovery-interval-secs")
    discovery_interval_secs: float = option(10.0, "seconds between readings of --worker-urls-file and "
                                            "--worker-dns")
    policy: str = option("cache_aware", "cache_aware: the meta radix tree with the load bound (as --dp-size); "
                         "round_robin: each request to the next healthy replica (a plain load balancer)",
                         choices=POLICIES)
    balance_abs_slack: int = option(4, "the load bound's absolute slack: a request goes to a replica with at most "
                                    "min_load + abs + floor(rel * min_load) requests in flight")
    balance_rel_slack: float = option(0.25, "the load bound's relative slack (see --balance-abs-slack)")
    cache_threshold: float = option(0.5, "a replica's cached prefix counts only if it covers at least this "
                                    "fraction of the prompt (shorter: routed as if no replica had it, to the least "
                                    "loaded), so that a header every prompt shares does not pile requests up")
    tokenizer_path: str | None = option(None, "tokenizer that turns prompts into the token ids routing keys on; "
                                        "default: the one the first replica reports, if the router can load "
                                        "it, else routing keys on the prompt text's UTF-8 bytes")
    health_check_interval_secs: float = option(5.0, "seconds between health checks (GET /health) of every "
                                               "replica")
    health_check_timeout_secs: float = option(5.0, "a health check answered later than this failed")
    health_failure_threshold: int = option(3, "consecutive failed health checks that take a replica out of "
                                           "routing (a request that cannot reach it takes it out at once)")
    health_success_threshold: int = option(1, "consecutive passed health checks that bring a replica back")
    retry_max_retries: int = option(2, "other replicas a request is sent to when its replica fails before "
                                    "sending anything back (connection refused or lost, 503)")
    request_timeout_secs: float = option(1800.0, "longest wait for a replica's next bytes; past it the "
                                         "client gets 504")
    max_payload_size: int = option(64 * 1024 * 1024, "largest request body in bytes; past it a 413")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every endpoint but /health and "
                                 "/metrics (the header is passed on to the replicas as it is)")
    log_level: str = option("info", "level of the router's log ('radixlm.router' logger)", choices=LOG_LEVELS)
    uvicorn_log_level: str = option("warning", "level of uvicorn's own log", choices=LOG_LEVELS)
