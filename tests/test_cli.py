"""`radixlm serve`'s command line: every flag documented, SGLang names and vLLM aliases, --version,
checks that fail fast before the model loads; and the options the flags added (context length, chat
template, stream interval, CORS)."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from starlette.testclient import TestClient

from radixlm import Engine
from radixlm.server import cli
from radixlm.core.runtime.options import EngineOptions
from radixlm.testing.checkpoints import tiny_model_path
from radixlm.server.app import create_app
from radixlm.server.args import ServerArgs
from radixlm.testing.servers import ServerProcess
from server_harness import shared_server


def run_cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "radixlm.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def parse(*args: str) -> dict:
    return vars(cli.build_parser().parse_args(["serve", *args]))


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_help:
        cli.main(["serve", "--help"])
    assert exit_help.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())
    for cls in (ServerArgs, EngineOptions):
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{f.name}: declare it with option(default, help)"
            assert "--" + f.name.replace("_", "-") in usage, f.name
            assert " ".join(f.metadata["help"].split()[:4]) in usage, f.name
            for alias in f.metadata.get("aliases", ()):
                assert alias in usage, alias
    assert "{lpm,dfs-weight,fcfs,lof,random}" in usage  # choices shown


@pytest.mark.parametrize("args, expected", [
    (["/m"], {"model": "/m"}),
    (["--model", "/m"], {"model_path": "/m"}),
    (["--max-model-len", "512"], {"context_length": 512}),
    (["--tokenizer", "/t"], {"tokenizer_path": "/t"}),
    (["--max-prefill-tokens", "4096"], {"chunked_prefill_size": 4096}),
    (["--max-num-batched-tokens", "2048"], {"chunked_prefill_size": 2048}),
    (["--max-num-seqs", "8"], {"max_running_requests": 8}),
    (["--gpu-memory-utilization", "0.5"], {"mem_fraction_static": 0.5}),
    (["--tensor-parallel-size", "2"], {"tp_size": 2}),
    (["-tp", "2"], {"tp_size": 2}),
    (["--data-parallel-size", "2"], {"dp_size": 2}),
    (["-dp", "2"], {"dp_size": 2}),
    (["--seed", "7"], {"random_seed": 7}),
    (["--trust-remote-code", "--log-requests"], {"trust_remote_code": True, "log_requests": True}),
    (["--no-disable-radix-cache"], {"disable_radix_cache": False}),
    (["--allowed-origins", "*", "https://a.example"], {"allowed_origins": ["*", "https://a.example"]}),
])
def test_aliases(args, expected):
    ns = parse(*args)
    assert {k: ns[k] for k in expected} == expected


def test_bad_values_are_one_line_errors(capsys):
    for args, message in ((["--max-running-requests", "x"], "invalid int value"),
                          (["--schedule-policy", "nope"], "invalid choice"),
                          (["--port", "0", "--stream-interval", "0"], "stream_interval must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["serve", *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, err


def test_version():
    proc, _ = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "radixlm 0.1.0"
    proc, _ = run_cli("serve", "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "radixlm 0.1.0"


def test_fast_failures_before_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, seconds = run_cli("serve", "--port", str(port))
    assert proc.returncode == 2 and seconds < 2.0, (seconds, proc.stderr)
    assert proc.stderr.strip() == f"radixlm serve: error: port {port} on 127.0.0.1 is already in use " \
                                  "(pick another with --port)"
    proc, _ = run_cli("serve", "--port", "0", str(tmp_path / "missing"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    proc, _ = run_cli("serve", "--port", "0", str(tmp_path))  # a directory without a model in it
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    proc, _ = run_cli("serve", "--port", "0", "--ssl-keyfile", str(tmp_path / "k.pem"))
    assert proc.returncode == 2 and "--ssl-keyfile and --ssl-certfile go together" in proc.stderr


def test_device_check(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--port", "0", "--device", "cuda"])
    assert exc.value.code == 2 and "no CUDA GPU is available" in capsys.readouterr().err


def test_context_length_chat_template_stream_interval(llama_ckpt, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    with Engine(llama_ckpt, context_length=40, chat_template=str(template), stream_interval=3) as engine:
        assert engine.context_len == 40
        with pytest.raises(ValueError, match="context is 40 tokens"):
            engine.generate(input_ids=[5] * 40, sampling_params={"max_new_tokens": 1})
        assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<x>"
        chunks = list(engine.generate("The fox", {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
                                      stream=True))
        assert [len(c["output_ids"]) for c in chunks] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="exceeds the model's"):
        Engine(llama_ckpt, context_length=1 << 30)


def test_cors_preflight(llama_ckpt):
    engine = shared_server(llama_ckpt).engine
    with TestClient(create_app(engine, ServerArgs(allowed_origins=["https://app.example"]))) as client:
        r = client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    with TestClient(create_app(engine)) as client:  # no --allowed-origins: no CORS
        r = client.options("/v1/chat/completions", headers={"Origin": "https://app.example",
                                                            "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers


def test_docs_table_is_generated_from_the_options():
    docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    assert cli.options_table() in docs, "regenerate docs/server.md's flag table with radixlm.server.cli.options_table()"


def test_serve_https_root_path_api_key_and_request_log(tmp_path):
    """`radixlm serve MODEL` as a user runs it: TLS, a proxy prefix, an API key, the request log."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = ServerProcess(tiny_model_path(), "--served-model-name", "tiny", "--ssl-keyfile", str(key),
                           "--ssl-certfile", str(cert), "--root-path", "/api", "--api-key", "k", "--log-requests")
    try:
        assert server.url.startswith("https://")
        with httpx.Client(base_url=server.url, verify=ssl.create_default_context(cafile=str(cert)),
                          timeout=60) as client:
            assert client.get("/health").status_code == 200  # open path, behind the prefix too
            assert client.get("/v1/models").status_code == 401
            models = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
            assert models["data"][0]["id"] == "tiny"
            r = client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                            json={"model": "whatever", "prompt": "Hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["model"] == "tiny"
            metrics = client.get("/metrics").text
        assert 'radixlm:http_requests_total{endpoint="/v1/completions",model_name="tiny",status="200"} 1.0' in metrics
    finally:
        server.signal()
    log = "".join(server.log)
    assert '"POST /api/v1/completions" 200' in log, log  # the access log shows the path as requested
    assert re.search(r"request \w+: prompt \d+ \(cached 0\), completion 3 tokens, ttft [0-9.]+s", log), log
