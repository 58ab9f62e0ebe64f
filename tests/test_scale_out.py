"""Scale-out on CPU: tensor parallelism over gloo in real processes (spawned by the engine, and under
torchrun) against tp=1; the data-parallel router's meta radix tree and balancing rule against brute-force
oracles; a dp=2 engine against dp=1. KV accounting is checked after each run (flush frees everything)."""

from __future__ import annotations

import json
import os
import queue
import random
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch.distributed

import radixlm
from radixlm.core.runtime.distributed.dp_router import DataParallelRouter
from radixlm.core.runtime.distributed.prefix_routing import MetaRadixTree, PrefixRouter
from radixlm.core.runtime.messages import Abort, FinishReason, GenerateOutput, GenerateRequest
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.errors import InvalidRequestError, UnsupportedModelError
from radixlm.testing.checkpoints import build_checkpoint

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
# Small chunks and pool: prompts prefill over several steps, so table writes cross step boundaries.
ENGINE = {"max_total_tokens": 1024, "chunked_prefill_size": 16, "max_running_requests": 8}
SHARED = list(range(40, 64))  # a 24-token shared prefix
WAVE1 = [SHARED + [300 + i, 301 + i, 302 + i] for i in range(3)] + [[7, 8, 9, 10, 11]]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- tensor parallelism ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_mqa_ckpt(ckpt_root: str) -> str:
    """Qwen2 (qkv bias, tied embeddings) with one KV head: at tp=2 the KV head is replicated."""
    return build_checkpoint(os.path.join(ckpt_root, "qwen2-mqa"), "qwen2", tie_word_embeddings=True, seed=5,
                            num_key_value_heads=1)


def _two_waves(path: str, **options) -> tuple[list[dict], dict]:
    """A batch sharing a prefix, then follow-ups that extend each prompt with its output (multi-turn)."""
    with radixlm.Engine(path, **ENGINE, **options) as engine:
        first = engine.generate(input_ids=WAVE1, sampling_params=GREEDY, return_logprob=True)
        follow = [ids + out["output_ids"] + [5, 6] for ids, out in zip(WAVE1, first)]
        second = engine.generate(input_ids=follow, sampling_params=GREEDY, return_logprob=True)
        engine.check_invariants()
        assert engine.flush_cache()
        stats = engine.get_stats()
    return first + second, stats


def _assert_same_greedy_run(got: list[dict], ref: list[dict]) -> None:
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    cached = [o["meta_info"]["cached_tokens"] for o in got]
    assert cached == [o["meta_info"]["cached_tokens"] for o in ref]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:3] + cached[4:])  # the radix cache was used
    for o, r in zip(got, ref):
        lp = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        lp_ref = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(lp_ref, abs=1e-4)


def test_tp2_in_spawned_processes_matches_tp1(qwen2_mqa_ckpt: str) -> None:
    """qkv bias, tied (vocab-parallel) embeddings, and one KV head replicated on both ranks."""
    ref, _ = _two_waves(qwen2_mqa_ckpt)
    got, stats = _two_waves(qwen2_mqa_ckpt, tp_size=2)
    _assert_same_greedy_run(got, ref)
    assert stats["kv_slots_free"] == stats["kv_slots_total"] == ENGINE["max_total_tokens"]
    assert stats["kv_slots_cached"] == 0
    # shutdown left the process group: another tensor-parallel engine may start in this process
    assert not torch.distributed.is_initialized()


_TORCHRUN_SCRIPT = """
import json, sys
import radixlm
from radixlm.core.runtime.distributed.tp_worker import launched_rank, run_launched_rank

path, out_path, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if launched_rank() == 0:
    with radixlm.Engine(path, tp_size=2, **options) as engine:
        outs = engine.generate(input_ids=json.loads(sys.argv[4]), sampling_params=json.loads(sys.argv[5]),
                               return_logprob=True)
        assert engine.flush_cache()
        stats = engine.get_stats()
    with open(out_path, "w") as f:
        json.dump({"outs": outs, "free": stats["kv_slots_free"], "total": stats["kv_slots_total"]}, f)
else:
    run_launched_rank(path, tp_size=2, **options)
"""


def test_tp2_under_torchrun_matches_tp1(mistral_ckpt: str, tmp_path) -> None:
    """Grouped-query attention (8 query heads on 2 KV heads): each rank holds 4 query heads and 1 KV head."""
    script = tmp_path / "tp_run.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out_path = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           mistral_ckpt, str(out_path), json.dumps(ENGINE), json.dumps(WAVE1), json.dumps(GREEDY)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_path.read_text())
    with radixlm.Engine(mistral_ckpt, **ENGINE) as engine:
        ref = engine.generate(input_ids=WAVE1, sampling_params=GREEDY, return_logprob=True)
    assert [o["output_ids"] for o in result["outs"]] == [o["output_ids"] for o in ref]
    assert [o["meta_info"]["cached_tokens"] for o in result["outs"]] == [o["meta_info"]["cached_tokens"] for o in ref]
    for o, r in zip(result["outs"], ref):
        lp = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx([x[0] for x in r["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert result["free"] == result["total"]


def test_tp4_over_two_nodes_with_sglang_flags_matches_tp1(mistral_ckpt: str) -> None:
    """SGLang's --nnodes / --node-rank / --dist-init-addr on one machine over gloo: "node" 0 is this
    process's Engine with its spawned rank 1, "node" 1 is `radixlm serve --node-rank 1` in another
    process with its ranks 2 (there) and 3 (spawned); all four meet at dist_init_addr. 8 query heads and 2
    KV heads over 4 ranks: each KV head is replicated on two ranks, on different "nodes"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = {"tp_size": 4, "nnodes": 2, "dist_init_addr": f"127.0.0.1:{port}"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE, **nodes, "node_rank": 1}.items()]
    node1 = subprocess.Popen([sys.executable, "-m", "radixlm.server.cli", "serve", "--model-path", mistral_ckpt,
                              *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        got, stats = _two_waves(mistral_ckpt, node_rank=0, **nodes)
        out, _ = node1.communicate(timeout=120)  # machine 1 returns once machine 0 shut down
        assert node1.returncode == 0, out[-3000:]
    finally:
        node1.kill()
    ref, _ = _two_waves(mistral_ckpt)
    _assert_same_greedy_run(got, ref)
    assert stats["kv_slots_free"] == stats["kv_slots_total"] == ENGINE["max_total_tokens"]


def test_multi_node_options_are_checked() -> None:
    for bad, param in (({"tp_size": 2, "nnodes": 2}, "dist_init_addr"),
                       ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "nnodes"),
                       ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank"),
                       ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "h:99999"}, "dist_init_addr")):
        with pytest.raises(InvalidRequestError) as err:
            EngineOptions.from_kwargs(bad)
        assert err.value.param == param


def test_scale_out_options_are_checked_before_anything_starts(llama_ckpt: str) -> None:
    with pytest.raises(InvalidRequestError):
        EngineOptions.from_kwargs({"tp_size": 2, "dp_size": 2})
    with pytest.raises(InvalidRequestError):
        EngineOptions.from_kwargs({"tp_size": 0})
    with pytest.raises(UnsupportedModelError, match="tp_size 3"):  # 4 heads do not split 3 ways
        radixlm.Engine(llama_ckpt, tp_size=3)


def test_serve_has_scale_out_flags(capsys: pytest.CaptureFixture) -> None:
    from radixlm.server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--tp-size" in help_text and "--dp-size" in help_text


# ---- the meta radix tree ----------------------------------------------------------------------------


def _random_seq(rng: random.Random) -> list[int]:
    return [rng.randrange(4) for _ in range(rng.randrange(13))]  # a small alphabet: many shared prefixes


def test_meta_tree_matches_brute_force() -> None:
    rng = random.Random(0)
    tree = MetaRadixTree(dict.fromkeys(range(3), 10**9))
    held: list[list[list[int]]] = [[], [], []]
    for _ in range(400):
        seq, worker = _random_seq(rng), rng.randrange(3)
        tree.insert(seq, worker)
        held[worker].append(seq)
        query = _random_seq(rng)
        expected = [max((_lcp(query, s) for s in seqs), default=0) for seqs in held]
        assert tree.match(query) == dict(enumerate(expected))
        assert tree.sizes == {w: _held_tokens(tree, w) for w in range(3)}


def _held_tokens(tree: MetaRadixTree, worker: int) -> int:
    return sum(len(n.key) for n in tree._nodes() if worker in n.workers)


def test_meta_tree_eviction_stays_within_capacity_and_keeps_recent() -> None:
    rng = random.Random(1)
    tree = MetaRadixTree({0: 40, 1: 24})
    held: list[list[list[int]]] = [[], []]
    for _ in range(300):
        seq, worker = _random_seq(rng), rng.randrange(2)
        tree.insert(seq, worker)
        held[worker].append(seq)
        assert tree.sizes[worker] <= tree.capacity[worker]
        assert tree.sizes == {w: _held_tokens(tree, w) for w in range(2)}
        assert tree.match(seq)[worker] == len(seq)  # the newest sequence is never the one evicted
        query = _random_seq(rng)
        brute = [max((_lcp(query, s) for s in seqs), default=0) for seqs in held]
        assert all(m <= b for m, b in zip(tree.match(query).values(), brute))  # the tree only forgets


def test_meta_tree_workers_join_and_leave_at_run_time() -> None:
    """The HTTP router's replicas come and go: a removed worker's marks vanish (nodes held by it alone
    with them), a worker added later starts empty, and the others' matches stay as brute force says."""
    rng = random.Random(3)
    tree = MetaRadixTree(dict.fromkeys("ab", 10**9))
    held: dict[str, list[list[int]]] = {"a": [], "b": []}
    for step in range(300):
        if step % 50 == 25:
            gone = rng.choice(sorted(held))
            tree.remove_worker(gone)
            del held[gone]
            new = f"w{step}"
            tree.add_worker(new, 10**9)
            held[new] = []
        seq, worker = _random_seq(rng), rng.choice(sorted(held))
        tree.insert(seq, worker)
        held[worker].append(seq)
        query = _random_seq(rng)
        assert tree.match(query) == {w: max((_lcp(query, s) for s in seqs), default=0) for w, seqs in held.items()}
        assert tree.sizes == {w: _held_tokens(tree, w) for w in held}
        assert all(n.workers for n in tree._nodes())  # no node left without a holder


def test_prefix_router_routes_only_among_the_given_workers() -> None:
    policy = PrefixRouter()
    for w in ("x", "y", "z"):
        policy.add_worker(w, 1000)
    assert policy.route([1, 2, 3]) == ("x", 0)
    assert policy.route([1, 2, 3, 4]) == ("x", 3)  # the prefix holder
    assert policy.route([1, 2, 3, 4], among=["y", "z"]) == ("y", 0)  # x failed or was tried already
    policy.finish("x")
    assert policy.loads == {"x": 1, "y": 1, "z": 0}
    policy.remove_worker("x")
    policy.finish("x")  # a request of a removed worker ends: nothing to count
    assert policy.route([1, 2, 3, 4]) == ("y", 4)
    with pytest.raises(LookupError):
        policy.route([1], among=[])


def test_a_short_shared_header_does_not_pile_requests_up_under_a_cache_threshold() -> None:
    """Two subjects whose prompts share a 4-token header: without a threshold the header alone sends the
    second subject to the first's worker; with cache_threshold 0.5 it goes to the idle worker, and later
    questions of each subject follow their subject (their match covers most of the prompt)."""
    header = [1, 2, 3, 4]
    subject = {s: header + [100 * s + k for k in range(12)] for s in (1, 2)}
    plain, thresholded = PrefixRouter(), PrefixRouter(cache_threshold=0.5)
    for policy in (plain, thresholded):
        policy.add_worker("a", 1000)
        policy.add_worker("b", 1000)
        assert policy.route(subject[1] + [7])[0] == "a"
    assert plain.route(subject[2] + [7]) == ("a", 4)
    assert thresholded.route(subject[2] + [7]) == ("b", 0)
    assert thresholded.route(subject[1] + [8]) == ("a", 16)
    assert thresholded.route(subject[2] + [8]) == ("b", 16)


# ---- the router -------------------------------------------------------------------------------------


class _HeldWorker:
    """A worker the test drives: it keeps what the router sends until the test finishes it."""

    def __init__(self, slots: int) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.allocator = SimpleNamespace(num_slots=slots)
        self.runner = SimpleNamespace(device="cpu")
        self._stopped = threading.Event()

    def run_forever(self) -> None:
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()


def _routed(workers: list[_HeldWorker]) -> tuple[int, object]:
    """Waits for the router to hand the last submitted message to a worker; returns (worker, message)."""
    for _ in range(500):
        for i, w in enumerate(workers):
            try:
                return i, w.inbox.get(timeout=0.01)
            except queue.Empty:
                pass
    raise AssertionError("the router forwarded nothing")


def _finish(router: DataParallelRouter, worker: int, inp: GenerateRequest, output_ids: list[int]) -> GenerateOutput:
    """The worker finishes the request: its output goes through its outbox to the router's."""
    router.workers[worker].outbox.put(GenerateOutput(inp.rid, output_ids, finish=FinishReason("length")))
    return router.outbox.get(timeout=10)


def test_router_follows_longest_prefix_within_the_load_bound_on_a_mixed_workload() -> None:
    """Arrivals (prefix groups of various sizes, unrelated prompts) interleaved with completions. Oracle:
    loads counted by the test, matches by brute force over what each worker was sent; every routing must
    stay within the bound (load <= min + 4 + min // 4) and pick a longest match among the eligible."""
    rng = random.Random(2)
    workers = [_HeldWorker(10**6) for _ in range(3)]
    router = DataParallelRouter(workers)
    thread = threading.Thread(target=router.run_forever, daemon=True)
    thread.start()
    prefixes = [[1000 + g] * 12 for g in range(6)]
    loads, sent = [0, 0, 0], [[], [], []]
    in_flight: list[tuple[int, GenerateRequest]] = []
    group_workers: dict[int, set[int]] = {}
    bursts_checked = 0
    for step in range(240):
        burst = step % 60 < 30  # half the time only arrivals, half mixed with completions
        if step % 60 == 0:  # arrivals keep the spread within slack + 1 if it starts there (as from idle)
            check_spread = max(loads) - min(loads) <= 4 + min(loads) // 4 + 1
            bursts_checked += check_spread
        if in_flight and not burst and rng.random() < 0.5:
            worker, inp = in_flight.pop(rng.randrange(len(in_flight)))
            out = _finish(router, worker, inp, [rng.randrange(50) for _ in range(3)])
            assert out.rid == inp.rid and out.dp_rank == worker
            loads[worker] -= 1
            sent[worker].append(inp.input_ids + out.output_ids)
            continue
        group = rng.randrange(8)  # 6 prefix groups, or (6, 7) an unrelated prompt
        ids = (prefixes[group] if group < 6 else [rng.randrange(50)]) + [rng.randrange(50) for _ in range(4)]
        inp = GenerateRequest(rid=f"r{step}", input_ids=ids, sampling_params=SamplingParams.from_dict({}))
        matched = [max((_lcp(ids, s) for s in seqs), default=0) for seqs in sent]
        limit = min(loads) + 4 + min(loads) // 4
        router.inbox.put(inp)
        worker, msg = _routed(workers)
        assert msg is inp
        assert loads[worker] <= limit
        assert matched[worker] == max(matched[w] for w in range(3) if loads[w] <= limit)
        loads[worker] += 1
        sent[worker].append(ids)
        in_flight.append((worker, inp))
        group_workers.setdefault(group, set()).add(worker)
        if burst and check_spread:
            assert max(loads) - min(loads) <= 4 + min(loads) // 4 + 1
    assert router.loads == loads
    assert bursts_checked >= 1 and len({w for ws in group_workers.values() for w in ws}) == 3
    # aborts go to the worker that holds the request; flushing waits until nothing is in flight
    worker, inp = in_flight[0]
    router.inbox.put(Abort(inp.rid))
    assert _routed(workers) == (worker, Abort(inp.rid))
    assert router.flush_cache() is False
    router.stop()
    thread.join(timeout=10)


def test_dp2_engine_routes_by_prefix_and_matches_dp1(llama_ckpt: str) -> None:
    group_a, group_b = list(range(10, 50)), list(range(100, 140))
    wave1 = [p + [200 + i] for i in range(3) for p in (group_a, group_b)]  # interleaved: a, b, a, b, ...
    wave2 = [group_a + [7, 8], group_b + [7, 8]]  # later turns of each conversation
    with radixlm.Engine(llama_ckpt, dp_size=2, **ENGINE) as engine:
        first = engine.generate(input_ids=wave1, sampling_params=GREEDY)
        second = engine.generate(input_ids=wave2, sampling_params=GREEDY)
        stats = engine.get_stats()
        engine.check_invariants()
        assert engine.flush_cache()
        flushed = engine.get_stats()
    with radixlm.Engine(llama_ckpt, **ENGINE) as engine:
        ref = engine.generate(input_ids=wave1 + wave2, sampling_params=GREEDY)
    assert [o["output_ids"] for o in first + second] == [o["output_ids"] for o in ref]
    rank = [o["meta_info"]["dp_rank"] for o in first]
    worker_a, worker_b = rank[0], rank[1]
    assert rank == [worker_a, worker_b] * 3 and worker_a != worker_b  # each group on one worker, both used
    assert [o["meta_info"]["dp_rank"] for o in second] == [worker_a, worker_b]
    assert all(o["meta_info"]["cached_tokens"] >= 40 for o in second)  # its worker really had the prefix
    assert stats["dp_in_flight"] == [0, 0] and len(stats["dp_workers"]) == 2
    assert stats["cached_tokens_total"] == sum(o["meta_info"]["cached_tokens"] for o in first + second)
    assert flushed["kv_slots_free"] == flushed["kv_slots_total"] == 2 * ENGINE["max_total_tokens"]
