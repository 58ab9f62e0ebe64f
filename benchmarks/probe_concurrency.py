"""Can a decode batch's attention run under a prefill's GEMMs on one GPU? (issue 19)

The 1,000-request run alternates prefill steps (GEMMs, compute-bound) and decode steps (paged attention,
bandwidth-bound). This probe times, on the 8B shape, each alone, one after the other on one stream, side by
side on two streams, and side by side with the SMs split between them (CUDA green contexts), to see how
much of one the other can hide before building mixed steps on it.

    python benchmarks/probe_concurrency.py --decode-batch 336 --context 825 --prefill-tokens 2048
"""
from __future__ import annotations

import argparse
import json

import torch

from radixlm.kernels.triton import decode_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 4096, 32, 8, 128, 14336, 32


def layer_weights(device):
    shapes = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * FFN), (FFN, HIDDEN)]
    return [torch.randn(k, n, device=device, dtype=torch.bfloat16) * 0.02 for k, n in shapes]


def gemm_layers(x, mid, weights, layers):
    """The four GEMMs of a layer per layer (a prefill's or a decode batch's share of the forward)."""
    qkv, o, gate_up, down = weights
    for _ in range(layers):
        torch.mm(x, qkv)
        torch.mm(x, o)
        torch.mm(x, gate_up)
        x = torch.mm(mid, down)
    return x


def build_decode(batch, context, device):
    tokens = batch * context
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # One token a slot, scattered like a pool that has been in use.
    slots = torch.randperm(tokens, device=device, dtype=torch.int32)
    req_to_token = slots.view(batch, context)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    pool = torch.arange(batch, device=device, dtype=torch.int32)
    return q, k, v, req_to_token, pool, seq_lens


def attention_layers(decode, layers):
    q, k, v, req_to_token, pool, seq_lens = decode
    for _ in range(layers):
        decode_attention(q, k, v, req_to_token, pool, seq_lens, HEAD_DIM ** -0.5)


def timed(fn, repeats=5):
    """Median ms of `fn` (which may use several streams; all joined before the end event)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def side_by_side(first, second, stream_a, stream_b):
    main = torch.cuda.current_stream()

    def run():
        for stream, work in ((stream_a, first), (stream_b, second)):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                work()
        main.wait_stream(stream_a)
        main.wait_stream(stream_b)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-batch", type=int, default=336)
    parser.add_argument("--context", type=int, default=825)
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--attention-sms", type=int, nargs="+", default=[16, 32, 48, 66])
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    weights = layer_weights(device)
    decode = build_decode(args.decode_batch, args.context, device)
    dx = torch.randn(args.decode_batch, HIDDEN, device=device, dtype=torch.bfloat16)
    dmid = torch.randn(args.decode_batch, FFN, device=device, dtype=torch.bfloat16)

    def decode_step():  # the decode batch's attention and GEMMs, as a decode step runs them
        q, k, v, req_to_token, pool, seq_lens = decode
        qkv, o, gate_up, down = weights
        for _ in range(LAYERS):
            torch.mm(dx, qkv)
            decode_attention(q, k, v, req_to_token, pool, seq_lens, HEAD_DIM ** -0.5)
            torch.mm(dx, o)
            torch.mm(dx, gate_up)
            torch.mm(dmid, down)

    attention = lambda: attention_layers(decode, LAYERS)
    step_ms = timed(decode_step)
    # The engine replays decode steps as CUDA graphs: the probe too, on streams of either priority.
    graph_stream = torch.cuda.Stream()
    graph_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(graph_stream):
        decode_step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step()
    rows = {"sms": sms, "attention_ms": timed(attention), "decode_step_ms": step_ms,
            "decode_graph_ms": timed(graph.replay)}
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    for tokens in args.prefill_tokens:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        mid = torch.randn(tokens, FFN, device=device, dtype=torch.bfloat16)
        prefill = lambda: gemm_layers(x, mid, weights, LAYERS)
        prefill_ms = timed(prefill)
        steps = max(1, round(prefill_ms / rows["decode_graph_ms"]))
        decodes = lambda: [graph.replay() for _ in range(steps)]
        row = {"prefill_ms": prefill_ms, "decode_steps": steps, "decodes_ms": timed(decodes)}
        row["serial_ms"] = timed(lambda: (prefill(), decodes()))
        row["streams_ms"] = timed(side_by_side(prefill, decodes, low, torch.cuda.Stream(priority=0)))
        row["streams_decode_high_ms"] = timed(side_by_side(prefill, decodes, low, high))
        row["streams_attention_only_ms"] = timed(side_by_side(prefill, attention, low, high))
        row["serial_attention_only_ms"] = timed(lambda: (prefill(), attention()))
        if torch.cuda.green_contexts.SUPPORTED:
            # SMs split between the two (torch 2.11 has no workqueue option: the driver's default applies).
            for part in args.attention_sms:
                try:
                    small, large = (torch.cuda.green_contexts.GreenContext.create(num_sms=n, device_id=device.index or 0)
                                    for n in (part, sms - part))
                    row[f"green_{part}_ms"] = timed(side_by_side(prefill, decodes, large.Stream(), small.Stream()))
                    row[f"green_{part}_attention_only_ms"] = timed(side_by_side(prefill, attention, large.Stream(),
                                                                                small.Stream()))
                except Exception as exc:  # noqa: BLE001 - a probe: report what the driver refused
                    row[f"green_{part}"] = repr(exc)[:200]
        rows[f"prefill_{tokens}"] = row
        print(json.dumps({tokens: row}), flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
