"""The `eagle` proposer (core/runtime/speculative/eagle.py, core/runtime/models/eagle.py) on the tiny Llama.

Oracles: the head's drafts against a plain-torch EAGLE forward written here from the EAGLE repository's
description, fed with transformers' hidden states of the target; outputs against the same engine with
speculation off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import radixlm
from radixlm.core.runtime.speculative.tree import DraftTree
from radixlm.core.errors import UnsupportedModelError
from radixlm.testing.eagle import (build_eagle_head, count_replays, head_inputs_differ, record_head_inputs,
                                   skip_some_drafts)
from test_speculative import MIXED, PROMPTS, assert_kv_whole, draft_pool_whole, engine


@pytest.fixture(scope="module")
def eagle_head(llama_ckpt, tmp_path_factory) -> str:
    return build_eagle_head(str(tmp_path_factory.mktemp("eagle") / "head"), llama_ckpt)


class Reference:
    """EAGLE heads computed from scratch in plain torch, fed with transformers' hidden states of the
    target: causal attention with RoPE over the whole sequence each step, SiLU MLP, residuals."""

    def __init__(self, target_dir: str, head_dir: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.cfg = json.loads(Path(head_dir, "config.json").read_text())
        self.w = load_file(str(Path(head_dir, "model.safetensors")))
        self.embed = self.target.get_input_embeddings().weight
        self.lm_head = self.target.get_output_embeddings().weight

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * weight

    def attention(self, x, p):  # x [T, in]: the layer's attention input, positions 0..T-1
        nh, nkv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        d, t, w = self.cfg["hidden_size"] // nh, len(x), self.w
        inv = 1.0 / self.cfg.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
        cos, sin = (torch.cat([f(ang), f(ang)], -1)[:, None].float() for f in (torch.cos, torch.sin))

        def rope(y):
            return y * cos + torch.cat([-y[..., d // 2:], y[..., :d // 2]], -1) * sin

        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, d)).repeat_interleave(nh // nkv, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, d).repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(self, x, p):
        w = self.w
        m = self.rms(x, w[p + "post_attention_layernorm.weight"])
        return (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T

    def head(self, version, feats, tokens):  # the head's outputs [T, hidden] at positions 0..T-1
        w, emb = self.w, self.embed[tokens]
        if version == 1:
            x = torch.cat([emb, feats], -1) @ w["fc.weight"].T + w["fc.bias"]
            h = x + self.attention(x, "layers.0.")
            return h + self.mlp(h, "layers.0.")
        p = "midlayer."
        h = feats + self.attention(torch.cat([self.rms(emb, w[p + "input_layernorm.weight"]),
                                              self.rms(feats, w[p + "hidden_norm.weight"])], -1), p)
        return h + self.mlp(h, p)

    def token(self, version, f):
        if version == 1:
            return int((f @ self.lm_head.T).argmax())
        j = int((self.rms(f, self.w["norm.weight"]) @ self.w["lm_head.weight"].T).argmax())
        return j + int(self.w["d2t"][j]) if "d2t" in self.w else j

    def drafts(self, version: int, prompt: list[int], k: int) -> tuple[int, list[int]]:
        """The target's greedy token after the prompt and the head's chain of k drafts after it."""
        with torch.no_grad():
            out = self.target(torch.tensor([prompt]), output_hidden_states=True)
            hs = [h[0] for h in out.hidden_states]  # hs[i]: what enters layer i; hs[-1]: the final, normed
            if version == 1:
                feats = hs[-1]
            else:
                n = len(hs) - 1
                feats = torch.cat([hs[2], hs[n // 2], hs[n - 3]], -1) @ self.w["fc.weight"].T
            first = int(out.logits[0, -1].argmax())
            tokens, drafts = prompt[1:] + [first], []
            for _ in range(k):
                f = self.head(version, feats, torch.tensor(tokens))[-1]
                drafts.append(self.token(version, f))
                feats, tokens = torch.cat([feats, f[None]]), tokens + [drafts[-1]]
        return first, drafts


    def tree(self, version: int, prompt: list[int], topk: int, steps: int, k: int) -> DraftTree:
        """EAGLE-2's tree as the engine builds it, each node's head output computed from its own path alone
        (the head run over the prompt and the path's tokens, the path's proposing outputs as its features)."""
        with torch.no_grad():
            out = self.target(torch.tensor([prompt]), output_hidden_states=True)
            hs = [h[0] for h in out.hidden_states]
            if version == 1:
                feats = hs[-1]
            else:
                n = len(hs) - 1
                feats = torch.cat([hs[2], hs[n // 2], hs[n - 3]], -1) @ self.w["fc.weight"].T
            tokens = prompt[1:] + [int(out.logits[0, -1].argmax())]
            # a node: (token, parent, score, the output that proposed it, depth)
            nodes = [(t, -1, v, self.head(version, feats, torch.tensor(tokens))[-1], 1)
                     for v, t in self.top(version, self.head(version, feats, torch.tensor(tokens))[-1], topk)]
            frontier = list(range(len(nodes)))
            for _ in range(steps - 1):
                children = []
                for f in frontier:
                    path, node = [], f
                    while node >= 0:
                        path.insert(0, node)
                        node = nodes[node][1]
                    h = self.head(version, torch.cat([feats] + [nodes[i][3][None] for i in path]),
                                  torch.tensor(tokens + [nodes[i][0] for i in path]))[-1]
                    children += [(t, f, nodes[f][2] + v, h, nodes[f][4] + 1) for v, t in self.top(version, h, topk)]
                best = sorted(range(len(children)), key=lambda c: -children[c][2])[:topk]
                frontier = [len(nodes) + c for c in best]
                nodes += children
        keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], nodes[i][4], i))[:k]
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree([nodes[i][0] for i in keep], [index.get(nodes[i][1], -1) for i in keep])

    def top(self, version, f, topk):
        """The head's topk (log-probability, target token id) after output f."""
        if version == 1:
            logp = torch.log_softmax(f @ self.lm_head.T, -1).topk(topk)
            return list(zip(logp.values.tolist(), logp.indices.tolist()))
        logp = torch.log_softmax(self.rms(f, self.w["norm.weight"]) @ self.w["lm_head.weight"].T, -1).topk(topk)
        d2t = self.w.get("d2t", torch.zeros(len(self.w["lm_head.weight"]), dtype=torch.int64))
        return [(v, j + int(d2t[j])) for v, j in zip(logp.values.tolist(), logp.indices.tolist())]


def first_proposals(e: radixlm.Engine) -> list:
    proposer = e.frontend.scheduler.scheduler.speculator.proposer
    seen: list = []
    propose = proposer.propose
    proposer.propose = lambda reqs, budgets: seen.append(propose(reqs, budgets)) or seen[-1]
    return seen


def test_eagle_drafts_equal_the_reference(llama_ckpt, eagle_head):
    prompt = PROMPTS[2]
    with engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                speculative_num_steps=4, speculative_adaptive=False) as e:
        seen = first_proposals(e)
        out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    first, drafts = Reference(llama_ckpt, eagle_head).drafts(1, prompt, 4)
    assert out["output_ids"][0] == first
    assert seen[0] == [drafts]


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_tree_drafts_equal_the_reference(llama_ckpt, deep_llama, eagle_head, eagle3_head, version):
    """speculative_eagle_topk 3, 3 steps, 8 nodes: the engine's first tree (the head run over the tree so
    far with a tree mask at each step) equals the tree built from every node's own path in plain torch; a
    sibling's keys leaking into a row would change that row's output and the children it proposes."""
    target, head = (llama_ckpt, eagle_head) if version == 1 else (deep_llama, eagle3_head)
    prompt = PROMPTS[2]
    with engine(target, speculative_algorithm="eagle" if version == 1 else "eagle3",
                speculative_draft_model_path=head, speculative_eagle_topk=3, speculative_num_steps=3,
                speculative_num_draft_tokens=8, speculative_adaptive=False) as e:
        seen = first_proposals(e)
        e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert_kv_whole(e)
        draft_pool_whole(e)
    expected = Reference(target, head).tree(version, prompt, 3, 3, 8)
    assert not expected.is_chain and max(expected.depth(i) for i in range(8)) == 3
    assert seen[0] == [expected]


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> str:
    """The tiny Llama with 8 layers: EAGLE-3 reads the inputs of layers 2, 4 and 5."""
    from radixlm.testing.checkpoints import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("deep") / "llama8"), "llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def eagle3_head(deep_llama, tmp_path_factory) -> str:
    from radixlm.testing.eagle import build_eagle3_head

    return build_eagle3_head(str(tmp_path_factory.mktemp("eagle3") / "head"), deep_llama, draft_vocab=300)


def test_eagle3_drafts_equal_the_reference_and_outputs_equal(deep_llama, eagle3_head):
    prompt = PROMPTS[2]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with engine(deep_llama) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=params)
    with engine(deep_llama, speculative_algorithm="eagle3", speculative_draft_model_path=eagle3_head,
                speculative_num_steps=4, speculative_adaptive=False) as e:
        seen = first_proposals(e)
        one = e.generate(input_ids=prompt, sampling_params=params)
        spec = e.generate(input_ids=PROMPTS, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
        draft_pool_whole(e)
    first, drafts = Reference(deep_llama, eagle3_head).drafts(3, prompt, 4)
    assert one["output_ids"][0] == first and seen[0] == [drafts]
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["spec_algorithm"] == "eagle3" and stats["spec_verifies_total"] > 0


def test_an_eagle3_head_lacking_a_tensor_or_a_deep_enough_target_is_refused(llama_ckpt, deep_llama, eagle3_head,
                                                                            tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    head = str(tmp_path / "head")
    shutil.copytree(eagle3_head, head)
    tensors = load_file(f"{head}/model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, f"{head}/model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"midlayer\.hidden_norm\.weight"):
        radixlm.Engine(deep_llama, speculative_algorithm="eagle3", speculative_draft_model_path=head)
    with pytest.raises(UnsupportedModelError, match="at least 7 layers"):  # the 2-layer model
        radixlm.Engine(llama_ckpt, speculative_algorithm="eagle3", speculative_draft_model_path=eagle3_head)


@pytest.mark.parametrize("adaptive,topk", [(False, 1), (True, 1), (False, 3)], ids=["fixed", "adaptive", "tree"])
def test_eagle_greedy_outputs_equal_and_metrics(llama_ckpt, eagle_head, adaptive, topk):
    """Chains and trees (topk 3: the kept path's target states feed the head's next catch-up)."""
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=MIXED)
    with engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                speculative_num_steps=3, speculative_adaptive=adaptive, speculative_eagle_topk=topk,
                speculative_num_draft_tokens=6) as e:
        spec = e.generate(input_ids=PROMPTS, sampling_params=MIXED)
        again = e.generate(input_ids=PROMPTS, sampling_params=MIXED)  # prompts from the radix cache now
        stats = e.get_stats()
        assert_kv_whole(e)
        draft_pool_whole(e)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in base]
    assert stats["spec_algorithm"] == "eagle" and "spec_accept_length" in stats
    if not adaptive:
        assert stats["spec_verifies_total"] > 0
        assert all("spec_accept_length" in o["meta_info"] for o in spec)


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_on_the_decode_graphs_keeps_outputs_and_the_heads_inputs(llama_ckpt, eagle_head, deep_llama,
                                                                      eagle3_head, version):
    """The target's and the head's decode steps on the decode graphs (their eager twin on the CPU: the same
    padded static buffers, the states the graphs export): outputs equal to speculation off's, and the head
    reads what it reads with every step eager (the target's states of decode steps and of verify steps
    replayed as decode rows, kept over steps; its own outputs from its graphs' buffer); both runners
    replayed such steps."""
    ckpt, head = (llama_ckpt, eagle_head) if version == 1 else (deep_llama, eagle3_head)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    spec = {"speculative_algorithm": "eagle" if version == 1 else "eagle3", "speculative_draft_model_path": head,
            "speculative_num_steps": 4, "speculative_adaptive": False}
    with engine(ckpt) as e:
        base = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=params)]
    runs = {}
    for graphs in (False, True):
        with engine(ckpt, **spec) as e:
            inputs = record_head_inputs(e)
            skip_some_drafts(e)
            if graphs:  # 24 rows: 4 requests x 5 verify rows (4 padding); a head step of 4 requests
                target = count_replays(e._runner, 24)
                heads = count_replays(e.frontend.scheduler.scheduler.speculator.proposer.runner, 24)
            out = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=params)]
            out.append(e.generate(input_ids=PROMPTS[3], sampling_params=params)["output_ids"])  # batch 1
            assert_kv_whole(e)
            draft_pool_whole(e)
        runs[graphs] = out, inputs
    assert runs[True][0] == runs[False][0] == base + [base[3]]
    # gpu_check_spec's HEAD_INPUT_BOUND: summation order alone moves fp32 inputs by up to ~5e-4 here; a wrong
    # row, position or overwritten state by O(1)
    assert head_inputs_differ(runs[True][1], runs[False][1], 1e-3) == []
    assert sum(len(set(b.rows)) < len(b.rows) for b in target) > 5  # verify steps: rows sharing a request
    assert any(len(set(b.rows)) == len(b.rows) and b.features is None for b in target)  # decode steps
    assert sum(b.features is not None for b in heads) > 5 and all(b.features is not None for b in heads)


@pytest.mark.parametrize("version", [1, 3])
def test_every_catch_up_reads_the_targets_state_at_its_position(llama_ckpt, eagle_head, deep_llama, eagle3_head,
                                                                version):
    """Each input the head takes from the target (a catch-up) is the target's state at that position of the
    final sequence (transformers' hidden states: the final ones, or EAGLE-3's three layers' inputs), for a
    request left without a draft one step in three (its head catches up over several steps' states),
    with both runners on the decode graphs' twin. Fails where states go before the head read them (they
    read zeros) or stand at wrong positions."""
    ckpt, head = (llama_ckpt, eagle_head) if version == 1 else (deep_llama, eagle3_head)
    prompt, params = PROMPTS[2], {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with engine(ckpt, speculative_algorithm="eagle" if version == 1 else "eagle3", speculative_draft_model_path=head,
                speculative_num_steps=4, speculative_adaptive=False) as e:
        inputs = record_head_inputs(e)
        skip_some_drafts(e)
        count_replays(e._runner, 24)
        count_replays(e.frontend.scheduler.scheduler.speculator.proposer.runner, 24)
        seq = prompt + e.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    with torch.no_grad():
        hs = [h[0] for h in Reference(ckpt, head).target(torch.tensor([seq]), output_hidden_states=True).hidden_states]
    n = len(hs) - 1
    want = hs[-1] if version == 1 else torch.cat([hs[2], hs[n // 2], hs[n - 3]], -1)
    catch_ups = [(p, t, f) for p, t, f, chain in inputs[tuple(prompt)] if not chain]
    read = sorted({p for p, _, _ in catch_ups})  # every position, up to the last step's
    assert read == list(range(len(read))) and len(read) >= len(seq) - 6
    for p, t, f in catch_ups:
        assert t == seq[p + 1]
        torch.testing.assert_close(f, want[p], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("damage,name", [("drop", "layers.0.mlp.up_proj.weight"), ("reshape", "fc.weight"),
                                         ("extra", "layers.0.input_layernorm.weight")])
def test_a_damaged_eagle_head_is_refused_naming_the_tensor(llama_ckpt, tmp_path, damage, name):
    from safetensors.torch import load_file, save_file

    head = build_eagle_head(str(tmp_path / "head"), llama_ckpt)
    path = Path(head, "model.safetensors")
    tensors = load_file(str(path))
    if damage == "drop":
        del tensors[name]
    elif damage == "reshape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        tensors[name] = torch.ones(tensors["fc.bias"].shape)
    save_file(tensors, str(path))
    with pytest.raises(UnsupportedModelError, match=name.replace(".", r"\.")):
        radixlm.Engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=head)


def test_eagle_options_are_checked(llama_ckpt, eagle_head):
    from radixlm.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        radixlm.Engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                       speculative_eagle_topk=0)
    assert err.value.param == "speculative_eagle_topk"
    with pytest.raises(InvalidRequestError) as err:  # a tree's mask holds 64 rows
        radixlm.Engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                       speculative_eagle_topk=2, speculative_num_draft_tokens=64)
    assert err.value.param == "speculative_num_draft_tokens"
    with pytest.raises(InvalidRequestError) as err:
        radixlm.Engine(llama_ckpt, speculative_algorithm="EAGLE")
    assert err.value.param == "speculative_draft_model_path"


def test_eagle_under_retraction_and_abort(llama_ckpt, eagle_head):
    """A small pool retracts requests mid-way (their head KV and kept states go, and come back as they
    resume); outputs equal, every slot of both pools comes back."""
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with engine(llama_ckpt, max_total_tokens=160) as e:
        base = e.generate(input_ids=prompts, sampling_params=params)
    with engine(llama_ckpt, max_total_tokens=160, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                speculative_adaptive=False) as e:
        spec = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.get_stats()
        assert_kv_whole(e)
        draft_pool_whole(e)
        assert not e.frontend.scheduler.scheduler.speculator.proposer.states
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    assert stats["retractions_total"] > 0 and stats["spec_verifies_total"] > 0


def test_kept_target_states_are_the_latest_of_each_position_in_few_pieces():
    """observe_target keeps, per request row, the newest state of every position (a verify step's rejected
    positions replaced by the next step's), in at most MAX_STATE_PIECES pieces that hold no whole step's
    copy alive; the proposal's trim keeps each piece at its own positions. Oracle: a dict of positions."""
    from types import SimpleNamespace

    from radixlm.core.runtime.execution.batch_input import BatchInput
    from radixlm.core.runtime.execution.hidden_export import HiddenExport
    from radixlm.core.runtime.speculative.eagle import MAX_STATE_PIECES, EagleProposer

    head = SimpleNamespace(num_slots=8, export=HiddenExport(), hidden_sink=None, dtype=torch.float32,
                           device=torch.device("cpu"))
    target = SimpleNamespace(export=HiddenExport(), cfg=SimpleNamespace(hidden_size=4), hidden_sink=None)
    proposer = EagleProposer(head, target, 100)
    g = torch.Generator().manual_seed(3)
    truth: dict[int, dict[int, torch.Tensor]] = {0: {}, 3: {}}

    def step(spans: list[tuple[int, int, int]]) -> None:  # (row, first position, tokens)
        batch = BatchInput(False, [], [], [], [], [], [], [])
        for row, first, n in spans:
            batch.rows.append(row)
            batch.extend_lens.append(n)
            batch.positions += range(first, first + n)
            truth[row] = {p: h for p, h in truth[row].items() if p < first}
        hidden = torch.randn(len(batch.positions), 4, generator=g)
        at = 0
        for row, first, n in spans:
            truth[row].update({first + j: hidden[at + j].clone() for j in range(n)})
            at += n
        proposer.observe_target(batch, hidden)
        hidden.fill_(float("nan"))  # the runner's buffer, overwritten by its next step

    step([(0, 0, 5), (3, 0, 2)])
    newest = {0: 5, 3: 2}
    for i in range(60):  # row 0 decodes; row 3 verifies 2 drafts, keeping 1 (2 new tokens a step)
        step([(0, newest[0], 1), (3, newest[3], 3)])
        newest[0] += 1
        newest[3] += 2
        if i == 30:  # a proposal's trim of what the head has read (positions below 20 of row 3)
            proposer._forget_states(3, 20)
            truth[3] = {p: h for p, h in truth[3].items() if p >= 20}
    for row, end in ((0, newest[0]), (3, newest[3] + 1)):  # row 3 holds its rejected last state too
        pieces = proposer.states[row]
        assert len(pieces) <= MAX_STATE_PIECES
        assert len({h.untyped_storage().data_ptr() for _, h in pieces}) <= MAX_STATE_PIECES
        want = torch.stack([truth[row].get(p, torch.zeros(4)) for p in range(end)])
        torch.testing.assert_close(proposer._target_states(row, 0, end), want)
