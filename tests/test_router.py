"""`radixlm router` over real `radixlm serve` processes on loopback (the tiny checkpoint): greedy outputs
through the router equal a replica's own; requests that share a prefix land where it is cached; replicas
join and leave through the discovery file and the admin endpoints; a replica killed under load loses no
request that had not started streaming, and the router stops sending to it within its health interval.
Oracles: the replicas called directly, and each replica's own counters."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from radixlm.server.router.args import RouterArgs
from radixlm.server.router.keys import RoutingKeys
from radixlm.server.router.policy import RoundRobin
from radixlm.server.router.replicas import ReplicaSet, normalize_url
from radixlm.testing.servers import ServerProcess

HEALTH_INTERVAL = 0.5
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _start(n: int, *flags: str) -> list[ServerProcess]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: ServerProcess(*flags), range(n)))


@pytest.fixture(scope="module")
def cluster(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory):
    """Replicas a, b (in the router's discovery file) and c (not yet), and the router."""
    a, b, c = _start(3, "--model-path", llama_ckpt, "--max-total-tokens", "4096")
    urls_file = tmp_path_factory.mktemp("router") / "replicas.txt"
    urls_file.write_text(f"# the replicas\n{a.url}\n{b.url}\n")
    router = None
    try:
        router = ServerProcess("--worker-urls-file", str(urls_file), "--discovery-interval-secs", "0.5",
                               "--health-check-interval-secs", str(HEALTH_INTERVAL), "--health-failure-threshold",
                               "1", "--tokenizer-path", llama_ckpt, command="router")
        yield SimpleNamespace(a=a, b=b, c=c, router=router, urls_file=urls_file, ckpt=llama_ckpt)
    finally:
        for p in (router, a, b, c):
            if p is not None:
                p.kill()


def _post_all(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies sent at once (each on its own connection), answers in order."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post(path, json=b) for b in bodies))

    return asyncio.run(go())


def _replicas(router: ServerProcess) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(router.url + "/list_workers").json()["replicas"]}


def _metric(router: ServerProcess, name: str) -> float:
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith(f"radixlm:router_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _served(replica: ServerProcess) -> int:
    """Requests the replica's own engine has received."""
    return httpx.get(replica.url + "/get_server_info").json()["internal_states"][0]["requests_total"]


def _wait_for(check, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def _sse_contents(text: str) -> tuple[list[str], list[str]]:
    """A chat stream's content deltas, and its raw data lines."""
    lines = [line for line in text.splitlines() if line.startswith("data: ")]
    contents = [json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in lines[:-1]]
    return contents, lines


def test_greedy_outputs_through_the_router_equal_a_replica_called_directly(cluster) -> None:
    router, a = cluster.router.url, cluster.a.url
    prompts = ["The quick brown fox", "A list of colours: red,", "def fib(n):"]
    for url in (router, a):  # warm both paths alike
        httpx.post(url + "/generate", json={"text": "warm", "sampling_params": GREEDY}, timeout=120)
    via = [httpx.post(router + "/generate", json={"text": p, "sampling_params": GREEDY}, timeout=120).json()
           for p in prompts]
    direct = [httpx.post(a + "/generate", json={"text": p, "sampling_params": GREEDY}, timeout=120).json()
              for p in prompts]
    assert [v["output_ids"] for v in via] == [d["output_ids"] for d in direct]
    batch = {"input_ids": [[5, 6, 7, 8], [9, 10, 11]], "sampling_params": GREEDY}
    assert [o["output_ids"] for o in httpx.post(router + "/generate", json=batch, timeout=120).json()] == \
        [o["output_ids"] for o in httpx.post(a + "/generate", json=batch, timeout=120).json()]

    completion = {"model": "x", "prompt": prompts[0], "max_tokens": 12, "temperature": 0}
    assert httpx.post(router + "/v1/completions", json=completion, timeout=120).json()["choices"][0]["text"] == \
        httpx.post(a + "/v1/completions", json=completion, timeout=120).json()["choices"][0]["text"]

    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0,
            "stream": True}
    via_stream = httpx.post(router + "/v1/chat/completions", json=chat, timeout=120)
    direct_stream = httpx.post(a + "/v1/chat/completions", json=chat, timeout=120)
    assert via_stream.headers["content-type"] == direct_stream.headers["content-type"]
    via_parts, via_lines = _sse_contents(via_stream.text)
    direct_parts, direct_lines = _sse_contents(direct_stream.text)
    # A replica joins the chunks that queued while its consumer was busy (delivery.merge_chunks), so two
    # requests' chunk boundaries may differ; their text and the stream's framing may not.
    assert "".join(via_parts) == "".join(direct_parts) and "".join(via_parts)
    assert via_lines[-1] == direct_lines[-1] == "data: [DONE]"

    # bad input gets the replica's (or the router's) OpenAI-style 400, never a 5xx
    bad = httpx.post(router + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(router + "/generate", content=b"{not json").json()["error"]["code"] == "invalid_json"


def test_requests_sharing_a_prefix_go_where_it_is_cached(cluster) -> None:
    """Two conversations, interleaved and concurrent: each stays on one replica, whose cache then holds
    its prefix (the replica's own cached_tokens says so); round-robin would split them."""
    router = cluster.router.url
    httpx.post(router + "/flush_cache")
    prefixes = [list(range(100, 160)), list(range(300, 360))]
    heads = _post_all(router, "/generate", [{"input_ids": p + [7], "sampling_params": GREEDY} for p in prefixes])
    assert all(r.status_code == 200 for r in heads)
    followers = [{"input_ids": p + [8 + i], "sampling_params": GREEDY} for i in range(3) for p in prefixes]
    outs = [r.json() for r in _post_all(router, "/generate", followers)]
    assert all(o["meta_info"]["cached_tokens"] >= 60 for o in outs)
    assert _metric(cluster.router, "prefix_routed_share") > 0


def test_replicas_join_and_leave_through_the_file_and_the_admin_endpoints(cluster) -> None:
    router, c = cluster.router, cluster.c
    cluster.urls_file.write_text(f"{cluster.a.url}\n{cluster.b.url}\n{c.url}\n")
    _wait_for(lambda: _replicas(router).get(c.url, {}).get("healthy"), 10, "c joining from the file")
    before = _served(c)
    bodies = [{"input_ids": [400 + i, 401, 402], "sampling_params": GREEDY} for i in range(9)]  # no shared prefix
    assert all(r.status_code == 200 for r in _post_all(router.url, "/generate", bodies))
    assert _served(c) > before  # a burst spreads over the three (least loaded first)

    cluster.urls_file.write_text(f"{cluster.a.url}\n{cluster.b.url}\n")
    _wait_for(lambda: c.url not in _replicas(router), 10, "c leaving with the file")
    before = _served(c)
    assert all(r.status_code == 200 for r in _post_all(router.url, "/generate", bodies))
    assert _served(c) == before

    added = httpx.post(router.url + "/add_worker", params={"url": c.url}, timeout=30)
    assert added.status_code == 200 and added.json() == {"url": c.url, "healthy": True}
    assert _replicas(router)[c.url]["source"] == "admin"
    assert httpx.post(router.url + "/add_worker", params={"url": c.url}).status_code == 400  # already there
    assert httpx.post(router.url + "/remove_worker", params={"url": c.url}).json() == {"url": c.url, "removed": True}
    assert httpx.post(router.url + "/remove_worker", params={"url": c.url}).status_code == 404
    unreachable = httpx.post(router.url + "/add_worker", params={"url": "http://127.0.0.1:9"}, timeout=30)
    assert unreachable.status_code == 400 and unreachable.json()["error"]["code"] == "replica_unreachable"
    assert httpx.post(router.url + "/add_worker", params={"url": "ftp://x"}).status_code == 400
    assert set(_replicas(router)) == {cluster.a.url, cluster.b.url}


def test_a_replica_killed_under_load_loses_no_request_that_had_not_started_streaming(cluster) -> None:
    router = cluster.router
    (d,) = _start(1, "--model-path", cluster.ckpt, "--max-total-tokens", "4096")
    try:
        assert httpx.post(router.url + "/add_worker", params={"url": d.url}, timeout=30).status_code == 200
        params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
        bodies = [{"input_ids": [20 + i, 21 + i, 22 + i], "sampling_params": params} for i in range(9)]
        streams = [{"input_ids": [60 + i, 61, 62], "sampling_params": params, "stream": True} for i in range(3)]

        async def load_then_kill() -> tuple[list[httpx.Response], int, float]:
            async with httpx.AsyncClient(base_url=router.url, timeout=300) as client:
                async def d_state() -> dict:
                    replicas = (await client.get("/list_workers")).json()["replicas"]
                    return next(r for r in replicas if r["url"] == d.url)

                calls = [asyncio.ensure_future(client.post("/generate", json=b)) for b in bodies + streams]
                while (await d_state())["in_flight"] == 0:  # d has requests running
                    await asyncio.sleep(0.02)
                on_d = (await d_state())["in_flight"]
                d.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                while (await d_state())["healthy"]:  # out of routing, timed from the kill, under load
                    await asyncio.sleep(0.02)
                out_after = time.monotonic() - killed
                return await asyncio.gather(*calls), on_d, out_after

        replies, on_d, out_after = asyncio.run(load_then_kill())
        killed = time.monotonic()
        assert [r.status_code for r in replies] == [200] * (len(bodies) + len(streams))
        unstreamed = [{k: v for k, v in b.items() if k != "stream"} for b in streams]
        direct = _post_all(cluster.a.url, "/generate", bodies + unstreamed)  # the oracle: the same requests
        expected = [r.json()["output_ids"] for r in direct]
        assert [r.json()["output_ids"] for r in replies[:len(bodies)]] == expected[:len(bodies)]
        broken = 0
        for reply, ids in zip(replies[len(bodies):], expected[len(bodies):]):
            events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
            if "replica_lost" in events[-1]:  # it had started streaming on d: cut, with an error event
                broken += 1
                assert ids[:len(json.loads(events[-2])["output_ids"])] == json.loads(events[-2])["output_ids"]
            else:  # finished where it was, or failed over before its first chunk
                assert events[-1] == "[DONE]" and json.loads(events[-2])["output_ids"] == ids
        assert _metric(router, "broken_streams_total") == broken
        assert on_d >= 1 and _metric(router, "failovers_total") >= on_d - broken
        assert out_after <= HEALTH_INTERVAL  # its broken connections take it out before the next check
        routed = _replicas(router)[d.url]["requests_total"]
        assert all(r.status_code == 200 for r in _post_all(router.url, "/generate", bodies[:4]))
        assert _replicas(router)[d.url]["requests_total"] == routed  # nothing more went to it
        assert time.monotonic() - killed < 120
    finally:
        d.kill()
        httpx.post(router.url + "/remove_worker", params={"url": d.url})


def test_an_idle_replica_killed_is_out_of_routing_within_its_health_interval(cluster) -> None:
    """No request on it to notice the loss: the health check alone takes it out, within one interval
    (--health-failure-threshold 1) plus the check's own time; requests sent meanwhile fail over."""
    router = cluster.router
    (d,) = _start(1, "--model-path", cluster.ckpt, "--max-total-tokens", "4096")
    try:
        assert httpx.post(router.url + "/add_worker", params={"url": d.url}, timeout=30).status_code == 200
        assert _replicas(router)[d.url]["healthy"] and _replicas(router)[d.url]["in_flight"] == 0
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        out_after = _wait_for(lambda: not _replicas(router)[d.url]["healthy"], 10, "d taken out")
        assert out_after <= HEALTH_INTERVAL + 0.5
        bodies = [{"input_ids": [500 + i, 501, 502], "sampling_params": GREEDY} for i in range(6)]
        assert all(r.status_code == 200 for r in _post_all(router.url, "/generate", bodies))
        assert _replicas(router)[d.url]["requests_total"] == 0
    finally:
        d.kill()
        httpx.post(router.url + "/remove_worker", params={"url": d.url})


# ---- without processes -------------------------------------------------------------------------------


def test_dns_discovery_finds_a_replica_by_name(cluster) -> None:
    port = cluster.a.url.rsplit(":", 1)[1]
    args = RouterArgs(worker_dns=f"localhost:{port}", health_check_timeout_secs=5)

    async def discover() -> dict:
        async with httpx.AsyncClient() as http:
            replicas = ReplicaSet(args, http, lambda replica, event: None)
            await replicas.discover()
            return {url: r.healthy for url, r in replicas.replicas.items()}

    found = asyncio.run(discover())
    assert found[f"http://127.0.0.1:{port}"] is True  # localhost may also name ::1, where nothing listens


def test_routing_keys_are_token_ids_of_what_the_replica_will_see(llama_ckpt: str) -> None:
    from radixlm.core.chat.render import render_chat
    from radixlm.core.runtime.tokenizer.loader import load_tokenizer

    keys, tok = RoutingKeys(llama_ckpt), load_tokenizer(llama_ckpt)
    assert keys.key("/generate", {"text": "hello there"}) == tok.encode("hello there", add_special_tokens=False)
    assert keys.key("/generate", {"input_ids": [[1, 2], [3]]}) == [1, 2]  # a batch routes on its first prompt
    assert keys.key("/v1/completions", {"prompt": [4, 5]}) == [4, 5]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]}]
    rendered = render_chat(tok, [{"role": "user", "content": "hi you"}], add_generation_prompt=True)
    assert keys.key("/v1/chat/completions", {"messages": messages}) == tok.encode(rendered, add_special_tokens=False)
    assert keys.key("/v1/chat/completions", {"messages": "not a list"}) == []
    no_tokenizer = RoutingKeys()
    assert no_tokenizer.key("/v1/completions", {"prompt": "hé"}) == list("hé".encode())
    with pytest.raises(ValueError, match="tokenizer-path"):
        RoutingKeys(os.devnull)


# Run in a fresh interpreter: imports the router's entry points, reads a tokenizer, renders a chat key,
# answers `radixlm router --help`, then names the heavy modules it loaded (none expected).
_LIGHT_ROUTER = """
import contextlib, io, sys
import radixlm.server.router.launch
from radixlm.server.cli import main
from radixlm.server.router.keys import RoutingKeys
keys = RoutingKeys(sys.argv[1])
assert keys.key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["router", "--help"])
    except SystemExit as exit:
        assert exit.code == 0, exit.code
assert "--worker-urls" in out.getvalue()
print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
"""


def test_the_router_imports_neither_torch_nor_transformers(llama_ckpt: str) -> None:
    """A router runs on a small CPU machine: its import path, its tokenizer and its --help load no torch."""
    done = subprocess.run([sys.executable, "-c", _LIGHT_ROUTER, llama_ckpt], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_gguf_tokenizer_not_yet_cached_is_refused_by_the_light_loader(tmp_path, monkeypatch) -> None:
    from radixlm.core.runtime.models.default_model import default_model_path
    from radixlm.core.runtime.tokenizer.loader import load_light_tokenizer

    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="no tokenizer of"):
        load_light_tokenizer(default_model_path())
    assert RoutingKeys().key("/generate", {"text": "ab"}) == [97, 98]  # the router's fallback: bytes


def test_round_robin_cycles_over_the_candidates() -> None:
    rr = RoundRobin()
    for w in "abc":
        rr.add_worker(w, 0)
    assert [rr.route([])[0] for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.route([], among=["c"])[0] == "c"
    rr.finish("a")
    assert rr.loads == {"a": 1, "b": 1, "c": 2}


def test_replica_urls_are_checked() -> None:
    assert normalize_url("127.0.0.1:30000/") == "http://127.0.0.1:30000"
    for bad in ("ftp://host:1", "http://host:1/v1", "http://:80", "http://h:99999"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_router_command_line(capsys: pytest.CaptureFixture) -> None:
    from radixlm.server.cli import main

    with pytest.raises(SystemExit):
        main(["router", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--worker-urls", "--worker-urls-file", "--worker-dns", "--policy", "--health-check-interval-secs"):
        assert flag in help_text
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--port", "0", "--worker-urls", "ftp://nope"])
    assert exit_info.value.code == 2 and "--worker-urls" in capsys.readouterr().err


def test_docs_list_every_router_flag() -> None:
    from pathlib import Path

    from radixlm.server.cli import router_options_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "scale_out.md").read_text()
    assert router_options_table() in docs, "regenerate docs/scale_out.md's router table with router_options_table()"
