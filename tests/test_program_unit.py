"""The program model without a model: IR, choice methods, chat-template recovery, speculation
matching, tracing and the compiler's passes; and the interpreter's concurrency and error mechanics,
on a scripted backend (a test double for the interpreter only: every model-facing behaviour is
tested on the real engine in test_program_engine.py)."""

from __future__ import annotations

import math
import threading
import time

import pytest

import radixlm as sgl
from radixlm.core.lang.backends.base import BaseBackend
from radixlm.core.lang.chat_template import chat_template_from_tokenizer, get_chat_template
from radixlm.core.lang.compiler import CompiledFunction
from radixlm.core.lang.ir import REGEX_INT, Constant, Fork, GenParams, GetForkItem, Select
from radixlm.core.lang.backends.speculative import TurnItem, cap_tokens, cut_at_stop, match_turn, token_ends


# ----- IR and parameters -----

def test_gen_params_merge_and_native_fields() -> None:
    defaults = GenParams.run_defaults(temperature=0.5, stop="\n")
    gen = sgl.gen("x", max_tokens=7, stop=["a", "b"], dtype=int)
    merged = defaults.override(gen.params)
    assert merged.temperature == 0.5 and merged.max_new_tokens == 7 and merged.stop == ["a", "b"]
    native = merged.sampling_params()
    assert native["regex"] == REGEX_INT
    assert native["stop"] == ["a", "b", " ", "\n"]
    assert GenParams.run_defaults().override(sgl.gen(json_schema={"type": "object"}).params) \
        .sampling_params()["json_schema"] == {"type": "object"}


def test_dsl_validation() -> None:
    with pytest.raises(ValueError):
        sgl.gen("x", dtype=list)
    with pytest.raises(Exception):
        sgl.gen("x", regex="(unclosed")
    with pytest.raises(ValueError):
        sgl.select("x", [])
    assert isinstance(sgl.gen("x", choices=["a", "b"]), Select)


# ----- choices methods, against hand-computed scores -----

def _lp(*values: float | None) -> list[tuple]:
    return [(v, i, None) for i, v in enumerate(values)]


def test_choice_methods() -> None:
    inputs = [_lp(-1.0, -1.0), _lp(-0.5, -3.0, -0.1), _lp(-0.5)]
    normalized = [sum(lp for lp, *_ in row) / len(row) for row in inputs]
    common = dict(choices=["a", "b", "c"], normalized_prompt_logprobs=normalized, input_token_logprobs=inputs,
                  output_token_logprobs=[[], [], []])
    # means: -1.0, -1.2, -0.5 -> c
    assert sgl.token_length_normalized(**common).decision == "c"
    # position 0: b and c tie at -0.5; position 1: b has -3.0, c is padded with its mean -0.5 -> c
    assert sgl.greedy_token_selection(**common).decision == "c"
    unconditional = [_lp(None, -2.0), _lp(None, -0.1, -0.1), _lp(None)]
    decision = sgl.unconditional_likelihood_normalized(**common, unconditional_token_logprobs=unconditional)
    # a: mean(-1-0, -1+2) = 0; b: mean(-0.5, -2.9, 0) = -1.133; c: -0.5 -> a
    assert decision.decision == "a"
    assert math.isclose(decision.meta_info["normalized_unconditional_prompt_logprobs"][1], (-0.5 - 2.9 + 0.0) / 3)


# ----- chat templates -----

def test_chat_template_from_tokenizer_reproduces_the_jinja_template(tokenizer_path: str) -> None:
    from radixlm.core.runtime.tokenizer.loader import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    template = chat_template_from_tokenizer(tokenizer)
    assert template is not None
    for messages in (
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
         {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
         {"role": "assistant", "content": "A2"}],
        [{"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}],
    ):
        assert template.get_prompt(messages) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert template.stop_token_ids == tuple(tokenizer.encode(template.stop_str[0], add_special_tokens=False))


def test_named_templates() -> None:
    chatml = get_chat_template("chatml")
    assert chatml.get_prompt([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(ValueError):
        get_chat_template("no-such-template")


# ----- speculation matching -----

def test_cut_at_stop() -> None:
    assert cut_at_stop(" Ann\nJob: x", ["\n"], complete=False) == " Ann"
    assert cut_at_stop("abc", ["\n"], complete=True) == "abc"
    assert cut_at_stop("abc", ["\n"], complete=False) is None
    assert cut_at_stop("a.b\nc", ["\n", "."], complete=False) == "a"


def test_token_boundaries_cap_speculated_gens() -> None:
    meta = {"output_token_logprobs": [(-0.1, None, " An"), (-0.2, None, "n"), (-0.3, None, "\nJ"), (-0.1, None, "ob")]}
    ends = token_ends(" Ann\nJob", meta)
    assert ends == [3, 4, 6, 8]
    assert token_ends("something else", meta) is None
    assert token_ends(" Ann", meta) == [3, 4]  # trailing tokens the text leaves out (an EOS)
    # " Ann" needs its 2 tokens plus the one that starts the stop "\n": 3 tokens
    assert cap_tokens(" Ann\nJob", " Ann", ends, 3) == " Ann"
    assert cap_tokens(" Ann\nJob", " Ann", ends, 2) == " Ann"  # the call ends by length, same text
    assert cap_tokens(" Ann\nJob", " Ann", ends, 1) == " An"
    assert cap_tokens(" Ann\nJob", " Ann", None, 1) == " Ann"  # boundaries unknown: the stop decides


def test_match_turn() -> None:
    params = GenParams.run_defaults(stop="\n")
    key = (1.0, 1.0, -1, 0.0, 0.0, 0.0, False)
    items = [TurnItem(text="Name:"), TurnItem(name="name", params=params), TurnItem(text="\nJob:"),
             TurnItem(name="job", params=params)]
    assert match_turn(items, "Name: Ann\nJob: cook\nmore", False, key) == ["Name:", " Ann", "\nJob:", " cook"]
    # the model ended the turn itself: the last gen takes the rest
    assert match_turn(items, "Name: Ann\nJob: cook", True, key) == ["Name:", " Ann", "\nJob:", " cook"]
    # the constant text does not match: that piece and everything after it are left to normal calls
    assert match_turn(items, "Name: Ann\nAge: 3\n", False, key) == ["Name:", " Ann", None, None]
    # a gen with other sampling parameters cannot be served by this call
    hot = GenParams.run_defaults(stop="\n", temperature=0.3)
    assert match_turn([TurnItem(name="x", params=hot)], "a\n", False, key) == [None]


# ----- tracing and compiling (no backend needed) -----

@sgl.function
def skeleton(s, topic):
    s += "Tips about " + topic + ":\n"
    forks = s.fork(2)
    forks += lambda i: f"Expand tip {i + 1}: " + sgl.gen("tip", max_tokens=4)
    forks.join()
    s += "Done." + sgl.gen("summary", max_tokens=4)


def test_trace_builds_the_graph() -> None:
    trace = skeleton.trace()
    streams = trace.all_streams()
    assert len(streams) == 3
    assert [type(n).__name__ for n in streams[0].nodes] == [
        "Constant", "Argument", "Constant", "Fork", "GatherVariables", "Constant", "Gen"]
    fork = streams[0].nodes[3]
    for i, child in enumerate(streams[1:]):
        assert isinstance(child.nodes[0], GetForkItem) and child.nodes[0].prev_node is fork
        assert child.nodes[0].index == i
        gen = child.nodes[-1]
        assert gen.name == "tip" and gen.pid == child.pid  # one node per place, even for a shared expr
    assert len(trace["tip"]) == 2 and {v.source.pid for v in trace["tip"]} == {s.pid for s in streams[1:]}
    assert "Fork" in trace.graph_text()
    assert skeleton.trace(topic="cats").prefix_text() == "Tips about cats:\n"


def test_data_dependent_control_flow_cannot_be_traced() -> None:
    @sgl.function
    def branches(s):
        s += "Q:" + sgl.select("a", ["yes", "no"])
        if s["a"] == "yes":
            s += "!"

    with pytest.raises(sgl.TracingError, match="'a'"):
        branches.trace()

    @sgl.function
    def formats(s, n):
        s += f"{n} items" + sgl.gen("x")

    with pytest.raises(sgl.TracingError, match="'n'"):
        formats.trace()
    assert formats.trace(n=3).prefix_text() == "3 items"


def test_compiler_hoists_the_common_start_of_fork_branches() -> None:
    compiled = CompiledFunction(skeleton)
    root = compiled.streams[compiled.root_pid]
    fork = next(n for n in root if isinstance(n, Fork))
    assert fork.hoisted_text == "Expand tip "
    branches = [nodes for pid, nodes in compiled.streams.items() if pid != compiled.root_pid]
    assert [b[1].value for b in branches] == ["1: ", "2: "]
    # adjacent constants merged: "Tips about " + topic + ":\n" keeps the argument between them
    assert [type(n).__name__ for n in root[:3]] == ["Constant", "Argument", "Constant"]
    assert isinstance(root[-2], Constant) and root[-2].value == "Done."


# ----- interpreter mechanics on a scripted backend -----

class ScriptedBackend(BaseBackend):
    """Answers every gen with a fixed text after an optional barrier (to prove concurrency);
    a gen whose max_new_tokens is 13 fails."""

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        super().__init__()
        self.barrier = barrier
        self.prompts: list[str] = []
        self.committed: list[str] = []
        self.lock = threading.Lock()

    def generate(self, s, params):
        with self.lock:
            self.prompts.append(s.text_)
        if params.max_new_tokens == 13:
            raise ValueError("unlucky request")
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        return "<out>", {"finish_reason": "stop"}

    def commit_lazy_operations(self, s, extra_text=""):
        self.committed.append(s.text_ + extra_text)


def test_forks_run_concurrently_and_commit_their_prefix_once() -> None:
    backend = ScriptedBackend(threading.Barrier(3))  # three branches must be in generate at once

    @sgl.function
    def three(s):
        s += "P"
        forks = s.fork(3)
        forks += [f"{i}" + sgl.gen("g", max_tokens=2) for i in range(3)]
        forks.join()

    state = three.run(backend=backend)
    assert state["g"] == ["<out>"] * 3 and state.error() is None
    assert backend.committed == ["P"]
    assert sorted(backend.prompts) == ["P0", "P1", "P2"]


def test_errors_stay_on_their_state() -> None:
    backend = ScriptedBackend()

    @sgl.function
    def prog(s, n):
        s += "x" + sgl.gen("a", max_tokens=n)
        s += "y"

    states = prog.run_batch([{"n": 2}, {"n": 13}, {"n": 3}], backend=backend)
    assert [s.error() is None for s in states] == [True, False, True]
    assert isinstance(states[1].error(), ValueError)
    with pytest.raises(sgl.ProgramError, match="unlucky"):
        states[1]["a"]
    assert states[0].text() == "x<out>y" and states[2]["a"] == "<out>"

    @sgl.function
    def host_error(s, n):
        s += "x"
        if n == 1:
            raise KeyError("host code")
        s += sgl.gen("a", max_tokens=2)

    states = host_error.run_batch([(0,), (1,)], backend=backend)
    assert states[0]["a"] == "<out>" and isinstance(states[1].error(), KeyError)
    with pytest.raises(KeyError):
        host_error.run(n=1, backend=backend)


def test_var_scope_roles_and_state_api() -> None:
    backend = ScriptedBackend()

    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "a" + sgl.gen("g", max_tokens=1) + "b"
        s += sgl.user("hi")
        s += sgl.assistant_begin() + "ok" + sgl.assistant_end()
        with s.copy() as c:
            c += "copy"

    state = prog.run(backend=backend)
    assert state["block"] == "a<out>b"
    assert state.messages() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert state.text().endswith("USER:hi\nASSISTANT:ok\n")
    assert "block" in state and "nothing" not in state
    with pytest.raises(KeyError):
        state["nothing"]
    with pytest.raises(TypeError):
        prog.run(backend=backend, unknown_argument=1)


def test_bind_and_batch_of_positional_arguments() -> None:
    backend = ScriptedBackend()

    @sgl.function
    def greet(s, greeting, name):
        s += greeting + ", " + name + sgl.gen("g", max_tokens=1)

    hello = greet.bind(greeting="Hello")
    assert hello.run(name="Ann", backend=backend).text() == "Hello, Ann<out>"
    states = greet.run_batch([("Hi", "Bo"), ("Yo", "Cy")], backend=backend, progress_bar=True, num_threads=2)
    assert [s.text() for s in states] == ["Hi, Bo<out>", "Yo, Cy<out>"]
    with pytest.raises(TypeError):
        greet.bind(nobody="x")


def test_a_read_waits_for_the_last_gen_of_a_name() -> None:
    class Counting(ScriptedBackend):
        def generate(self, s, params):
            super().generate(s, params)
            time.sleep(0.05 if len(self.prompts) == 1 else 0)  # the first call is the slow one
            return f"<{len(self.prompts)}>", {}

    @sgl.function
    def twice(s):
        for _ in range(3):
            s += sgl.gen("x", max_tokens=1)

    state = twice.run(backend=Counting())
    assert state["x"] == "<3>" and state.text() == "<1><2><3>"


def test_set_default_backend_keeps_a_runtime_as_given() -> None:
    """As SGLang does: a Runtime stays what it is (code reads `default_backend.endpoint`), and programs
    resolve it to its endpoint where they run; a backend stays as given; anything else fails at once."""
    class Runtime:  # SGLang's Runtime shape: a launched server behind `.endpoint`
        def __init__(self) -> None:
            self.endpoint = ScriptedBackend()

    @sgl.function
    def hello(s):
        s += "Hi " + sgl.gen("g", max_tokens=2)

    runtime = Runtime()
    try:
        sgl.set_default_backend(runtime)
        assert sgl.global_config.default_backend is runtime
        assert sgl.global_config.default_backend.endpoint is runtime.endpoint
        assert hello.run()["g"] == "<out>" and runtime.endpoint.prompts == ["Hi "]
        backend = ScriptedBackend()
        sgl.set_default_backend(backend)
        assert sgl.global_config.default_backend is backend
        with pytest.raises(TypeError, match="not a backend"):
            sgl.set_default_backend(object())
        assert sgl.global_config.default_backend is backend
    finally:
        sgl.global_config.default_backend = None
