"""The GGUF start-up shortcuts against what they replace: radixlm's torch dequantizers equal the `gguf`
package's numpy ones to the bit (many tensors of several shapes at once, as the loader runs them), and
the tokenizer read back from the cache behaves as the one transformers builds from the file."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import PreTrainedTokenizerFast

from radixlm.core.runtime.cache import cache_dir
from radixlm.core.runtime.models import gguf_dequant
from radixlm.core.runtime.models.default_model import default_model_path
from radixlm.core.runtime.models.gguf_checkpoint import GGUFCheckpoint, _runs
from radixlm.core.runtime.tokenizer.loader import load_gguf_tokenizer

FAST_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
SHAPES = [(3, 64), (32, 96), (1, 32), (5, 7, 128)]


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda q: q.name)
def test_dequantize_equals_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    raws, expected = [], []
    for shape in SHAPES:
        values = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0)).astype(np.float32)
        values.flat[0] = 0.0  # a block with an exact zero, and one of equal values
        values.reshape(-1)[32:64] = 0.5
        data = gguf.quants.quantize(values, qtype)
        raws.append(torch.from_numpy(data.view(np.uint8).reshape(-1).copy()))
        expected.append(torch.from_numpy(gguf.quants.dequantize(data.view(np.uint8), qtype)).reshape(shape))
    assert gguf_dequant.dequantizes(qtype)
    ours = gguf_dequant.dequantize(raws, qtype, SHAPES)
    for got, want in zip(ours, expected):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want)


def test_other_types_are_left_to_gguf():
    assert not any(gguf_dequant.dequantizes(q) for q in (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q2_K))


def test_smollm2_weights_equal_gguf_dequantization():
    """Every tensor of the default model, as the loader gets it (in runs), equals gguf's dequantization."""
    ckpt = GGUFCheckpoint(default_model_path())
    infos = list(ckpt.tensors.values())
    runs = list(_runs(infos))
    assert sorted(i.name for run in runs for i in run) == sorted(i.name for i in infos)
    assert len(runs) < len(infos) // 4  # runs of many tensors, the point of them
    for run in runs:
        for info, got in zip(run, ckpt._dequantize_run(run)):
            raw = np.frombuffer(ckpt._buf, np.uint8, count=info.nbytes, offset=info.offset)
            want = gguf.quants.dequantize(raw.reshape(-1, info.nbytes // info.shape[0]), info.qtype)
            assert torch.equal(got, torch.from_numpy(want).reshape(info.shape)), info.name


def _behaviour(tok) -> tuple:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> ünï ☃"}]
    return (
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False),
        tok("  Hello world\n\tcode();  <|im_start|>x")["input_ids"],
        tok.decode(list(range(0, 400, 3))),
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, len(tok),
        tok.all_special_tokens, tok.is_fast,
    )


def test_tokenizer_cache_behaves_as_the_gguf_build(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    path = default_model_path()
    directory, name = os.path.split(path)
    built = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
    first = load_gguf_tokenizer(path)  # builds and saves
    (entry,) = (cache_dir() / "gguf-tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    second = load_gguf_tokenizer(path)  # reads the cache
    assert _behaviour(first) == _behaviour(built) == _behaviour(second)
    # A damaged entry is rebuilt, not trusted.
    (entry / "tokenizer.json").write_text("{ not json")
    third = load_gguf_tokenizer(path)
    assert _behaviour(third) == _behaviour(built)
    # An unwritable cache costs time, not the tokenizer.
    shutil.rmtree(tmp_path / "gguf-tokenizers")
    (tmp_path / "gguf-tokenizers").write_text("a file where the folder should be")
    assert _behaviour(load_gguf_tokenizer(path)) == _behaviour(built)
