"""config.json read the way transformers reads it: both config generations (transformers 4's
`rope_theta`/`rope_scaling`, transformers 5's `rope_parameters`) and the config classes' defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_engine_hf import HFOracle
from transformers import LlamaConfig, MistralConfig, Qwen2Config

import radixlm
from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.config import ModelConfig

SHAPE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}
CLASSES = {"LlamaForCausalLM": LlamaConfig, "MistralForCausalLM": MistralConfig, "Qwen2ForCausalLM": Qwen2Config}


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_defaults_are_the_config_classes_defaults(arch):
    ours = ModelConfig.from_hf_dict({"architectures": [arch], **SHAPE}, eos=None)
    theirs = CLASSES[arch](**SHAPE)
    theta = theirs.rope_parameters["rope_theta"] if hasattr(theirs, "rope_parameters") else theirs.rope_theta
    window = getattr(theirs, "sliding_window", None) if getattr(theirs, "use_sliding_window", True) else None
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.rope_theta == theta and ours.rope_scaling is None
    assert ours.context_len == min(theirs.max_position_embeddings, window or theirs.max_position_embeddings)
    assert ours.num_kv_heads == 4 and ours.head_dim == 16


def _rewrite_config(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    path = dst / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))
    return str(dst)


def _as_transformers5(cfg: dict) -> None:
    """What transformers 5 writes: the rope base only inside `rope_parameters`."""
    cfg.pop("rope_theta", None)
    cfg.pop("rope_scaling", None)


def _as_transformers4(cfg: dict) -> None:
    """What transformers 4 writes: top-level `rope_theta`, `rope_scaling` with the old `type` key."""
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **params}


@pytest.mark.parametrize("writer", [_as_transformers5, _as_transformers4], ids=["transformers5", "transformers4"])
@pytest.mark.parametrize("fixture", ["llama_ckpt", "llama3_rope_ckpt"])
def test_both_config_generations_give_hf_logits(request, tmp_path, writer, fixture):
    src = request.getfixturevalue(fixture)
    ckpt = _rewrite_config(src, tmp_path / "ckpt", writer)
    cfg = ModelConfig.from_dir(ckpt)
    assert cfg.rope_theta == 500000.0
    if fixture == "llama_ckpt":
        assert cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "llama3"
        assert cfg.rope_scaling["factor"] == 8.0
    oracle = HFOracle(ckpt)
    prompt = "A long enough prompt that rotary positions matter for every one of its tokens, " * 3
    with radixlm.Engine(ckpt, max_total_tokens=1024) as engine:
        out = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True,
                              logprob_start_len=0)
    ids = oracle.tok(prompt)["input_ids"]
    ref = oracle.logprobs(ids)
    ours = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    assert torch.allclose(ours, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'yarn'"),
])
def test_unsupported_config_fields_are_named(field, value, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **SHAPE, field: value}, eos=None)


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_registry_places_every_checkpoint_weight(arch):
    """Each weight of transformers' model of the architecture maps (core.runtime.models.registry) onto a
    parameter of ours of its shape, or onto one block of a fused one; the blocks tile each fused
    parameter, and every parameter of ours gets a weight."""
    import transformers

    from radixlm.kernels import cpu as cpu_ops
    from radixlm.core.runtime.models.registry import model_spec

    shape = {**SHAPE, "num_key_value_heads": 2}
    with torch.device("meta"):
        hf = getattr(transformers, arch)(CLASSES[arch](**shape))
    cfg = ModelConfig.from_hf_dict({"architectures": [arch], **shape}, eos=None)
    spec = model_spec(arch)
    with torch.device("meta"):
        params = dict(spec.model_class(cfg, cpu_ops).named_parameters())
    blocks: dict[str, list[slice]] = {}
    for name, weight in hf.state_dict().items():
        ours, block = spec.parameter_for(name)
        if block is None:
            assert params[ours].shape == weight.shape, name
        else:
            rows = spec.block_rows(ours, block, cfg)
            assert params[ours][rows].shape == weight.shape, name
            blocks.setdefault(ours, []).append(rows)
    for ours, rows in blocks.items():
        rows.sort(key=lambda r: r.start)
        assert [r.start for r in rows] == [0] + [r.stop for r in rows[:-1]], ours
        assert rows[-1].stop == params[ours].shape[0], ours
    assert {spec.parameter_for(name)[0] for name in hf.state_dict()} == set(params)


def test_registry_refuses_an_unknown_architecture():
    from radixlm.core.runtime.models.registry import model_spec

    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        model_spec("GPTNeoXForCausalLM")
