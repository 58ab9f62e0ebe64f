"""gguf_kernel="ggml" (core.runtime.quantization.ggml_product): ggml's product on a GGUF weight's
blocks against x @ W.T with W from gguf's own numpy dequantizer, within the error of the activations'
8-bit blocks, on one and two threads; the default model (SmolLM2-135M-Instruct: Q4_1 projections, tied
Q8_0 head) with every product on ggml against the dequantized fp32 model: prompt logprobs and the quick
start's answers; its threadpool asleep while the engine is idle; the errors that name the fix when
libggml-python is missing or of another version."""

from __future__ import annotations

import time
from importlib import metadata

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import radixlm
from radixlm.core.errors import InvalidRequestError, UnsupportedModelError
from radixlm.core.runtime.quantization import ggml_product
from radixlm.core.runtime.quantization.ggml_product import KEPT_ROWS, GgmlDecoderLayer, GgmlLinear, GgmlThreads

# The README's quick start (benchmarks/bench_quant.py's questions and system prompt).
SYSTEM = ("You are a concise assistant for a geography and general-knowledge quiz. Answer each question "
          "in one short sentence.")
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?", "How many legs does a spider have?",
             "What is 12 plus 7?", "What is the largest ocean on Earth?", "Which planet is known as the Red Planet?"]
TEXT = ("radixlm serves language models with a radix-tree prefix cache: requests that share a prompt prefix "
        "reuse its attention keys and values instead of computing them again, and a scheduler orders the "
        "waiting requests so that those sharing the longest cached prefix run first.")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, KEPT_ROWS + 6])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_product_against_the_dequantized_weight(qtype, rows, threads):
    """ggml quantizes each block of 32 activations to int8 with d = max|x| / 127 (stored in fp16):
    |x - x'| <= max|x_block| / 254 + 2^-11 |x'|. So each output is within sum over blocks of
    max|x_block| / 254 * sum |W| over the block, plus 2^-9 of sum |x||W| (the fp16 scales, Q4_1's
    fp16 block sums, fp32 sums). Graphs of up to KEPT_ROWS rows are kept: each row count twice. On two
threads ggml splits the product between them."""
    rng = np.random.default_rng(0)
    n, k = 40, 128
    raw = gguf.quants.quantize(rng.normal(0, 0.2, (n, k)).astype(np.float32), qtype)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(n, k)
    bias = torch.randn(n)
    layer = GgmlLinear(qtype.name, torch.from_numpy(raw.reshape(-1)), (n, k), bias, GgmlThreads(threads))
    for _ in range(2):
        x = torch.randn(rows, k) * torch.rand(rows, k) * 4  # blocks of unlike ranges
        want = x @ w.t() + bias
        block_max = x.abs().view(rows, k // 32, 32).amax(-1)  # [rows, blocks]
        w_sums = w.abs().view(n, k // 32, 32).sum(-1)  # [n, blocks]
        bound = block_max @ w_sums.t() / 254 + 2 ** -9 * (x.abs() @ w.abs().t()) + 1e-5
        got = layer(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())
    assert (rows in layer.graphs) == (rows <= KEPT_ROWS)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16  # the output in the model's dtype


@pytest.mark.parametrize("threads", [1, 2])
def test_decoder_layer_graphs_against_torch(threads):
    """GgmlDecoderLayer (a batch-1 layer as two ggml graphs) on Q8_0 weights with a bias on every
    projection (Qwen2's qkv has one) against the layer written out in torch on the dequantized weights,
    `attend` a stand-in: within 2% (relative) of the layer's update to the residual stream, and the next
    layer's qkv (its graph here: next_layer) within 2% of itself (measured: 1.2-1.3%, ggml's 8-bit
    activations); SwiGLU's halves swapped would be off by ~50%."""
    rng = np.random.default_rng(1)
    hidden, q_size, qkv_size, inter, eps = 64, 64, 128, 96, 1e-5
    threads = GgmlThreads(threads)

    def linear(n, k):
        raw = gguf.quants.quantize(rng.normal(0, 0.2, (n, k)).astype(np.float32), Q.Q8_0)
        bias = torch.randn(n) * 0.1
        layer = GgmlLinear("Q8_0", torch.from_numpy(raw.reshape(-1)), (n, k), bias, threads)
        return layer, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)).reshape(n, k), bias

    (qkv, w_qkv, b_qkv), (o, w_o, b_o) = linear(qkv_size, hidden), linear(hidden, q_size)
    (gate_up, w_gu, b_gu), (down, w_down, b_down) = linear(2 * inter, hidden), linear(hidden, inter)
    norms = (torch.rand(hidden) + 0.5, torch.rand(hidden) + 0.5)
    layer = GgmlDecoderLayer(qkv, o, gate_up, down, norms, eps, first=True, next_layer=(qkv, norms[0]))

    def attend(x):
        return torch.tanh(x[:, :q_size] + x[:, q_size:])

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    for _ in range(2):  # the kept graphs again
        h = torch.randn(1, hidden) * 2
        mid = h + attend(rms(h, norms[0]) @ w_qkv.t() + b_qkv) @ w_o.t() + b_o
        gu = rms(mid, norms[1]) @ w_gu.t() + b_gu
        want = mid + (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w_down.t() + b_down
        got, next_qkv = layer(h, None, attend)
        assert got.shape == want.shape and float((got - want).norm()) <= 0.02 * float((want - h).norm())
        next_want = rms(got, norms[0]) @ w_qkv.t() + b_qkv
        assert float((next_qkv - next_want).norm()) <= 0.02 * float(next_want.norm())


@pytest.fixture(scope="module")
def engines():
    with radixlm.Engine(log_level="warning") as plain, \
            radixlm.Engine(quantization="gguf", gguf_kernel="ggml", log_level="warning") as ggml:
        yield plain, ggml


@pytest.fixture(scope="module")
def unfused():
    """gguf_kernel="ggml" with each batch-1 layer's norms, adds and SwiGLU on torch between its four
    products (decode_fused_gemv=0), where the default runs the layers as ggml graphs, one per layer boundary."""
    with radixlm.Engine(quantization="gguf", gguf_kernel="ggml", decode_fused_gemv=0, log_level="warning") as engine:
        yield engine


def _greedy(engine, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """TEXT's prompt logprobs (a prefill, teacher-forced), then those of `new_tokens` greedy tokens (batch-1
    decode) and the tokens."""
    out = engine.generate(TEXT, {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    return (torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]]),
            torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]]),
            [t for _, t, _ in meta["output_token_logprobs"]])


def _answers(engine, batched: bool) -> list[str]:
    """The quick start's six answers, greedy: batched (as bench_quant.py --accuracy asks them) or one
    request at a time (batch-1 decode steps)."""
    prompts = [engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                                    tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    params = {"max_new_tokens": 32, "temperature": 0}
    if batched:
        return [out["text"] for out in engine.generate(prompts, params)]
    return [engine.generate(prompt, params)["text"] for prompt in prompts]


def test_default_model_on_ggml_keeps_logprobs_and_answers(engines):
    """Every kept product is ggml's at one row (a batch-1 decode step: the Q4_1 projections and the Q8_0
    head), the head at any row count, the projections on torch's int4 kernel above one row. Against the
    dequantized fp32 model: TEXT's next-token logprobs (a prefill, teacher-forced) and those of 40
    greedy tokens after it (batch-1 decode: each layer as ggml graphs, GgmlDecoderLayer; before the first
    token that differs) each within 0.5, 0.15 on average (measured: prefill 0.057 mean / 0.27 max, decode
    0.041 / 0.12 over the 9 tokens before; 0.027 / 0.13 over 23 with the layers unfused; torch's
    kernels 0.041 / 0.14 in the prefill: the Q4_1 weights, and ggml's 8-bit activations, llama.cpp's
    own); the quick start's six answers the same, batched and one at a time."""
    plain, ggml = engines
    model = ggml._runner.model
    layers = (model.lm_head, model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj,
              model.layers[-1].mlp.gate_up_proj, model.layers[-1].mlp.down_proj)
    assert all(type(m).__name__ == "GgmlLinear" for m in layers)
    assert model.lm_head.many_rows is None  # Q8_0: ggml at every row count
    assert type(model.layers[0].mlp.down_proj.many_rows).__name__ == "Int4GroupLinear"
    assert ggml._runner.ggml_threads.threads == torch.get_num_threads()
    assert len(model.ggml_layers) == len(model.layers)  # batch-1 layers as ggml graphs (GgmlDecoderLayer)
    prefill, decode, tokens = zip(*(_greedy(engine, 40) for engine in engines))
    same = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), len(tokens[0]))
    assert same >= 5  # measured: 9 (23 with torch's norms between ggml's products: decode_fused_gemv=0)
    for delta in ((prefill[0] - prefill[1]).abs(), (decode[0][:same] - decode[1][:same]).abs()):
        assert float(delta.mean()) <= 0.15 and float(delta.max()) <= 0.5, delta
    for batched in (True, False):
        want = _answers(plain, batched)
        assert "Paris" in want[0] and "Tokyo" in want[1]  # the oracle itself answers
        assert _answers(ggml, batched) == want


def test_fused_layers_against_unfused(engines, unfused):
    """The batch-1 layers as ggml graphs against the same products with torch's norms, adds and SwiGLU
    between them: the same prefill (no fused layer above one row); bit for bit the same layer when given the
    same input, but torch's fused add-and-norm rounds unlike ggml's, and an activation on an 8-bit step's
    edge then rounds the other way, so the decode logprobs differ by as much as either does from the fp32
    model (measured: 0.033 mean / 0.12 max over the 9 tokens before the first that differs): the same bound
    as against the dequantized model; the six answers one at a time the same."""
    _, fused = engines
    assert unfused._runner.model.ggml_layers == []
    (prefill, decode, tokens), (prefill_u, decode_u, tokens_u) = _greedy(fused, 40), _greedy(unfused, 40)
    assert torch.equal(prefill, prefill_u)
    same = next((i for i, (a, b) in enumerate(zip(tokens, tokens_u)) if a != b), len(tokens))
    assert same >= 5  # measured: 9
    delta = (decode[:same] - decode_u[:same]).abs()
    assert float(delta.mean()) <= 0.15 and float(delta.max()) <= 0.5, delta
    assert _answers(fused, False) == _answers(unfused, False)


def test_ggml_threads_sleep_while_idle(engines):
    """Once a request is done the loop pauses ggml's workers: no core spins while nothing runs (without
    the pause they would poll for ~0.17 s after the last graph)."""
    _, ggml = engines
    ggml.generate(TEXT, {"max_new_tokens": 8, "temperature": 0})
    time.sleep(0.05)  # the loop's turn after the last step
    start = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - start < 0.03


def test_missing_or_other_libggml_named(monkeypatch):
    monkeypatch.setattr(ggml_product, "_LIB", None)

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(ggml_product.metadata, "version", missing)
    with pytest.raises(UnsupportedModelError, match=r"pip install 'radixlm\[ggml\]'"):
        ggml_product.library()
    monkeypatch.setattr(ggml_product.metadata, "version", lambda name: "0.9.0")
    with pytest.raises(UnsupportedModelError, match=r"libggml-python==0\.20\.2\.post1 \(installed: 0\.9\.0\)"):
        ggml_product.library()


def test_ggml_only_with_gguf_on_the_cpu():
    with pytest.raises(InvalidRequestError, match="quantization='gguf' on the CPU"):
        radixlm.Engine(gguf_kernel="ggml", log_level="warning")
