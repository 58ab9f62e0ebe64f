"""`sgl.RuntimeEndpoint`: programs on a radixlm (or SGLang) server through its native `/generate`;
`sgl.Runtime`: starts such a server in a child process and points an endpoint at it."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator

from radixlm.core.lang.backends.native import NativeGenerateBackend
from radixlm.core.lang.chat_template import (
    chat_template_from_tokenizer, get_chat_template, get_chat_template_by_model_path,
)
from radixlm.core.lang.errors import ProgramError

if TYPE_CHECKING:
    import httpx  # imported when used: the HTTP client is an optional dependency ([server])


class RuntimeEndpoint(NativeGenerateBackend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = True,
                 chat_template_name: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        super().__init__()
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, verify=verify, timeout=timeout)
        self.model_info = self._get("/get_model_info")
        # select scores token ids, so it needs the server's tokenizer; a server on this machine
        # (Runtime) reports a path we can load it from.
        self.tokenizer = _try_load_tokenizer(self.model_info.get("tokenizer_path") or self.model_info.get("model_path"))
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = (chat_template_from_tokenizer(self.tokenizer) if self.tokenizer is not None else None) \
                or get_chat_template_by_model_path(self.model_info.get("model_path"))
        self.supports_vision = "image_token" in self.model_info  # a vision-language model is served
        if self.supports_vision:
            self.chat_template = dataclasses.replace(self.chat_template, image_token=self.model_info["image_token"])
        self.supports_video = "video_token" in self.model_info
        if self.supports_video:
            self.chat_template = dataclasses.replace(self.chat_template, video_token=self.model_info["video_token"])

    def get_model_name(self) -> str:
        return self.model_info.get("served_model_name") or self.model_info.get("model_path")

    def _get(self, path: str) -> Any:
        response = self._http.get(path)
        check_response(response)
        return response.json()

    def _generate(self, request: dict[str, Any]) -> Any:
        response = self._http.post("/generate", json=request)
        check_response(response)
        return response.json()

    def _generate_stream(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The server streams cumulative text and output logprobs; this yields only what is new."""
        from httpx_sse import connect_sse

        sent_text, sent_logprobs = 0, 0
        with connect_sse(self._http, "POST", "/generate", json={**request, "stream": True}) as source:
            if source.response.status_code != 200:
                source.response.read()
                check_response(source.response)
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    return
                chunk = json.loads(event.data)
                if "error" in chunk:  # the server ended the stream (a deadline, the engine stopping, ...)
                    raise ProgramError(f"the server ended the stream: {chunk['error']['message']}")
                meta = chunk["meta_info"]
                text = chunk["text"]
                if "output_token_logprobs" in meta:
                    whole = meta["output_token_logprobs"]
                    meta["output_token_logprobs"] = whole[sent_logprobs:]
                    sent_logprobs = len(whole)
                yield {"text": text[sent_text:], "meta_info": meta}
                sent_text = len(text)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ProgramError(f"select needs the server's tokenizer, which could not be loaded from "
                               f"{self.model_info.get('tokenizer_path')!r} on this machine")
        return self.tokenizer(text)["input_ids"]  # the server's tokenizer, loaded here: as its front end does

    def flush_cache(self) -> bool:
        return self._http.post("/flush_cache").status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")


def check_response(response: "httpx.Response") -> None:
    if response.status_code != 200:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        raise ProgramError(f"{response.request.url} answered {response.status_code}: {body}")


def _try_load_tokenizer(path: str | None) -> Any:
    if not path or not os.path.exists(path):  # a checkpoint folder or .gguf file on this machine
        return None
    from radixlm.core.runtime.tokenizer.loader import load_tokenizer
    try:
        return load_tokenizer(path)
    except Exception:
        return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _option_flags(options: dict[str, Any]) -> list[str]:
    """Engine options as `radixlm serve` flags (--kebab-case VALUE, --flag / --no-flag)."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class Runtime:
    """A radixlm server in a child process (`python -m radixlm.server`), for programs to use
    through `.endpoint`. `shutdown()` stops it (also at interpreter exit)."""

    def __init__(self, model_path: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 api_key: str | None = None, launch_timeout: float = 300.0, log_level: str = "error",
                 **engine_options: Any) -> None:
        import httpx

        self.port = port or _free_port()
        self.url = f"http://{host}:{self.port}"
        command = [sys.executable, "-m", "radixlm.server", "--host", host, "--port", str(self.port),
                   *_option_flags({"model_path": model_path, "api_key": api_key, "log_level": log_level,
                                   **engine_options})]
        self._process: subprocess.Popen | None = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        atexit.register(self.shutdown)
        deadline = time.monotonic() + launch_timeout
        while True:
            if self._process.poll() is not None:
                self._process = None
                raise RuntimeError(f"the server exited while starting (command: {' '.join(command)})")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"the server did not start within {launch_timeout} s")
            time.sleep(0.5)
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def get_tokenizer(self) -> Any:
        return self.endpoint.tokenizer

    def shutdown(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # the server shuts down cleanly on SIGTERM
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
