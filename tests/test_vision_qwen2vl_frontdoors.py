"""Images through the front doors on the tiny Qwen2-VL checkpoint, end to end: an SGLang-style image QA
program (gen and select), the official `openai` client against the real server with image_url data
URLs, ChatSGLang with a LangChain image block, and a DSPy signature with a dspy.Image field.

Oracle: transformers' Qwen2VLForConditionalGeneration on the same weights (tests/qwen2vl_oracle.py)."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage

import radixlm
import radixlm as sgl
from radixlm.testing.vision import QWEN2_VL_IMAGE, build_qwen2_vl_checkpoint, png_bytes, sample_image
from qwen2vl_oracle import Qwen2VLOracle
from server_harness import LiveServer
from test_vision_frontdoors import image_pick, image_qa  # the same programs as on LLaVA

IMAGE, OTHER_IMAGE = sample_image(3, (84, 56)), sample_image(4, (100, 100))
PNG = png_bytes(IMAGE)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
QUESTION = "What is in this picture?"
MAX = 8


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory) -> str:
    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2vl-doors") / "ckpt"))


@pytest.fixture(scope="module")
def engine(qwen2vl):
    with radixlm.Engine(qwen2vl, max_total_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle(qwen2vl) -> Qwen2VLOracle:
    return Qwen2VLOracle(qwen2vl)



def test_image_qa_program(engine, oracle):
    expected = oracle.greedy_text(oracle.prompt(QUESTION), IMAGE, MAX)
    for source in (PNG, IMAGE):
        state = image_qa.run(image=source, question=QUESTION, backend=engine)
        assert state.error() is None
        assert state["answer"] == expected
    states = image_qa.run_batch([{"image": IMAGE, "question": QUESTION},
                                 {"image": OTHER_IMAGE, "question": QUESTION}], backend=engine)
    assert [s["answer"] for s in states] == [expected, oracle.greedy_text(oracle.prompt(QUESTION), OTHER_IMAGE, MAX)]


def test_select_after_an_image(engine, oracle):
    """select's logprob positions shift by the image's width, which the engine reports (Qwen2-VL's
    depends on the image's size)."""
    choices = ["cat", "dog", "a small bird"]
    for image in (IMAGE, OTHER_IMAGE):
        state = image_pick.run(image=image, backend=engine)
        assert state.error() is None
        scores = oracle.choice_scores(oracle.prompt("Is it a cat or a dog?"), image, choices)
        assert state["animal"] == choices[max(range(3), key=scores.__getitem__)]
        assert state.get_meta_info("animal")["normalized_prompt_logprobs"] == pytest.approx(scores, abs=2e-4)


def chat_messages(url: str = DATA_URL) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def test_openai_chat_with_an_image(live, oracle):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    expected = oracle.greedy_text(oracle.prompt(QUESTION), IMAGE, MAX)
    first = client.chat.completions.create(model=live.model, messages=chat_messages(), max_tokens=MAX, temperature=0)
    assert first.choices[0].message.content == expected
    assert first.usage.prompt_tokens == len(oracle.inputs(oracle.prompt(QUESTION), IMAGE)["input_ids"][0])
    second = client.chat.completions.create(model=live.model, messages=chat_messages(), max_tokens=MAX, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1  # image included
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        client.chat.completions.create(model=live.model, max_tokens=2, messages=chat_messages(
            "data:image/png;base64," + base64.b64encode(b"not a png").decode()))
    info = httpx.get(live.url + "/get_model_info").json()
    assert info["image_token"] == QWEN2_VL_IMAGE and info["tokens_per_image"] is None


def test_chat_sglang_image_block(engine, live, oracle):
    from radixlm.adapters.langchain import ChatSGLang

    expected = oracle.greedy_text(oracle.prompt(QUESTION), IMAGE, MAX)
    block = {"type": "image", "base64": base64.b64encode(PNG).decode(), "mime_type": "image/png"}
    for target in ({"engine": engine}, {"base_url": live.url}):
        llm = ChatSGLang(**target, temperature=0, max_tokens=MAX)
        reply = llm.invoke([HumanMessage([block, {"type": "text", "text": QUESTION}])])
        assert reply.content == expected


def test_dspy_image_field(engine, oracle):
    import dspy

    from radixlm.adapters.dspy import SGLangLM

    describe = dspy.Predict(dspy.Signature("picture: dspy.Image -> answer: str", "Describe the picture."))
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=80, max_field_chars=4, cache=False)
    usage = []
    with dspy.context(lm=lm):
        for image in (IMAGE, IMAGE, OTHER_IMAGE):
            url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
            result = describe(picture=dspy.Image(url))
            assert isinstance(result.answer, str)
            usage.append(lm.history[-1]["usage"])
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    # IMAGE is 84x56 pixels: a 6x4 patch grid, 6 positions after the 2x2 merge; OTHER_IMAGE (100x100,
    # resized to 112x112) 16.
    assert usage[0]["prompt_tokens"] - usage[2]["prompt_tokens"] == 6 - 16
    assert cached[1] >= usage[1]["prompt_tokens"] - 1  # the same image: served from the cache
    assert cached[2] < usage[2]["prompt_tokens"] - 16  # another image: only the text before it


# ----- video -----

FRAMES = [sample_image(20 + i, (84, 56)) for i in range(4)]


@sgl.function
def video_qa(s, frames, question):
    s += sgl.user(sgl.video(frames) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=MAX, temperature=0))


def test_video_program_and_native_generate(engine, live, oracle):
    """sgl.video's frames reach the engine as a video (grid t = 2), on the engine and through the
    server's /generate video_data; the answer is transformers' on the same video."""
    import numpy as np
    import torch

    from qwen2vl_oracle import video_inputs

    prompt = oracle.tok.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|>" + QUESTION}], tokenize=False,
        add_generation_prompt=True)
    inputs = video_inputs(oracle, prompt, FRAMES)
    with torch.no_grad():
        ids = oracle.model.generate(**inputs, max_new_tokens=MAX, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    cut = next((i for i, t in enumerate(ids) if t in oracle.stops), len(ids))
    expected = oracle.tok.decode(ids[:cut], skip_special_tokens=True)
    array = np.stack([np.asarray(frame) for frame in FRAMES])
    for frames in (FRAMES, array):
        assert video_qa.run(frames=frames, question=QUESTION, backend=engine)["answer"] == expected
    assert video_qa.run(frames=FRAMES, question=QUESTION, backend=sgl.RuntimeEndpoint(live.url))["answer"] == expected
    body = {"text": prompt, "video_data": [[f"data:image/png;base64,{base64.b64encode(png_bytes(f)).decode()}"
                                            for f in FRAMES]],
            "sampling_params": {"max_new_tokens": MAX, "temperature": 0, "stop_token_ids": sorted(oracle.stops)}}
    assert httpx.post(live.url + "/generate", json=body, timeout=60).json()["text"] == expected
    assert httpx.get(live.url + "/get_model_info").json()["video_token"] == "<|vision_start|><|video_pad|><|vision_end|>"
