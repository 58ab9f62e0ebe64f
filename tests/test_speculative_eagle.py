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
from radixlm.core.errors import UnsupportedModelError
from radixlm.testing.eagle import build_eagle_head
from test_speculative import MIXED, PROMPTS, assert_kv_whole, draft_pool_whole, engine


@pytest.fixture(scope="module")
def eagle_head(llama_ckpt, tmp_path_factory) -> str:
    return build_eagle_head(str(tmp_path_factory.mktemp("eagle") / "head"), llama_ckpt)


def reference_drafts(target_dir: str, head_dir: str, prompt: list[int], k: int) -> tuple[int, list[int]]:
    """The target's greedy token after the prompt and the head's chain of k drafts after it, computed
    from scratch: transformers' final hidden states h, then per position i fc([embed(x_{i+1}), h_i]),
    causal attention with RoPE, SiLU MLP, residuals, and the target's lm_head."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = json.loads(Path(head_dir, "config.json").read_text())
    w = load_file(str(Path(head_dir, "model.safetensors")))
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    theta = cfg.get("rope_theta", 10000.0)
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * weight

    def rope(x, pos):  # x [T, heads, d]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.outer(torch.tensor(pos, dtype=torch.float64), inv)
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float(), torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def head(feats, tokens):  # positions 0..T-1; returns the head's outputs [T, hidden]
        x = torch.cat([embed[tokens], feats], -1) @ w["fc.weight"].T + w["fc.bias"]
        p = "layers.0."
        t = len(tokens)
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d), list(range(t)))
        kk = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, d), list(range(t)))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, d)
        kk, v = kk.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / d ** 0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d)
        h = x + attn @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        feats, tokens = out.hidden_states[-1][0], prompt[1:] + [first]
        drafts = []
        for _ in range(k):
            f = head(feats, torch.tensor(tokens))[-1]
            drafts.append(int((f @ lm_head.T).argmax()))
            feats, tokens = torch.cat([feats, f[None]]), tokens + [drafts[-1]]
    return first, drafts


def test_eagle_drafts_equal_the_reference(llama_ckpt, eagle_head):
    prompt = PROMPTS[2]
    with engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                speculative_num_steps=4, speculative_adaptive=False) as e:
        proposer = e.frontend.scheduler.scheduler.speculator.proposer
        seen = []
        propose = proposer.propose
        proposer.propose = lambda reqs, budgets: seen.append(propose(reqs, budgets)) or seen[-1]
        out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    first, drafts = reference_drafts(llama_ckpt, eagle_head, prompt, 4)
    assert out["output_ids"][0] == first
    assert seen[0] == [drafts]


@pytest.mark.parametrize("adaptive", [False, True])
def test_eagle_greedy_outputs_equal_and_metrics(llama_ckpt, eagle_head, adaptive):
    with engine(llama_ckpt) as e:
        base = e.generate(input_ids=PROMPTS, sampling_params=MIXED)
    with engine(llama_ckpt, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head,
                speculative_num_steps=3, speculative_adaptive=adaptive) as e:
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
                       speculative_eagle_topk=4)
    assert err.value.param == "speculative_eagle_topk"
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
