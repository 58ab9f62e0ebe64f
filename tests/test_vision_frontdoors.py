"""Images through every front door on the tiny LLaVA checkpoint, end to end: an SGLang-style image QA
program (gen and select), the official `openai` client against the real server with image_url data
URLs, ChatSGLang with LangChain image blocks (in-process and through the server, plus langchain-tests'
own test_image_inputs), and a DSPy signature with a dspy.Image field through SGLangLM.

Oracle: transformers' LlavaForConditionalGeneration on the same weights, fed by its own LlavaProcessor
(greedy text up to the first stop token; choice logprobs for select)."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
import torch
from langchain_core.messages import HumanMessage
from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor

import radixlm
import radixlm as sgl
from radixlm.core.errors import InvalidRequestError
from radixlm.testing.vision import build_llava_checkpoint, png_bytes, sample_image
from server_harness import LiveServer

IMAGE, OTHER_IMAGE = sample_image(3), sample_image(4, (50, 60))
PNG = png_bytes(IMAGE)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
QUESTION = "What is in this picture?"
MAX = 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_llava_checkpoint(str(tmp_path_factory.mktemp("llava-doors") / "ckpt"))


@pytest.fixture(scope="module")
def engine(llava):
    with radixlm.Engine(llava, max_total_tokens=4096, max_image_pixels=20_000) as engine:
        yield engine


@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(engine)
    yield server
    server.stop()


class Oracle:
    def __init__(self, path: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.processor = LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=self.tok,
                                        patch_size=14, vision_feature_select_strategy="default",
                                        num_additional_image_tokens=1)
        self.model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.stops = {self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")}

    def prompt(self, question: str, images: int = 1) -> str:
        content = "<image>" * images + question
        return self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                            add_generation_prompt=True)

    @torch.no_grad()
    def greedy_text(self, prompt: str, image, n: int = MAX) -> str:
        inputs = self.processor(text=prompt, images=image, return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        cut = next((i for i, t in enumerate(ids) if t in self.stops), len(ids))
        return self.tok.decode(ids[:cut], skip_special_tokens=True)

    @torch.no_grad()
    def choice_scores(self, prompt: str, image, choices: list[str]) -> list[float]:
        """Mean logprob of each choice's tokens after the prompt (what select's default method ranks)."""
        n_prompt = self.processor(text=prompt, images=image, return_tensors="pt")["input_ids"].shape[1]
        scores = []
        for choice in choices:
            inputs = self.processor(text=prompt + choice, images=image, return_tensors="pt")
            ids = inputs["input_ids"][0]
            logprobs = torch.log_softmax(self.model(**inputs).logits[0].float(), -1)
            picked = [logprobs[p - 1, ids[p]].item() for p in range(n_prompt, len(ids))]
            scores.append(sum(picked) / len(picked))
        return scores


@pytest.fixture(scope="module")
def oracle(llava) -> Oracle:
    return Oracle(llava)


# ----- the SGLang DSL -----

@sgl.function
def image_qa(s, image, question):
    s += sgl.user(sgl.image(image) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=MAX, temperature=0))


@sgl.function
def image_pick(s, image):
    s += sgl.user(sgl.image(image) + "Is it a cat or a dog?")
    s += sgl.assistant(sgl.select("animal", choices=["cat", "dog", "a small bird"]))


def test_image_qa_program(engine, oracle, tmp_path):
    backend = sgl.EngineBackend(engine)
    path = tmp_path / "picture.png"
    path.write_bytes(PNG)
    expected = oracle.greedy_text(oracle.prompt(QUESTION), IMAGE)
    for source in (str(path), PNG, IMAGE):  # a path, bytes, a PIL image
        state = image_qa.run(image=source, question=QUESTION, backend=backend)
        assert state.error() is None
        assert state["answer"] == expected
    # a batch over two images: each answer is its own image's
    states = image_qa.run_batch([{"image": IMAGE, "question": QUESTION},
                                 {"image": OTHER_IMAGE, "question": QUESTION}], backend=backend)
    assert [s["answer"] for s in states] == [expected, oracle.greedy_text(oracle.prompt(QUESTION), OTHER_IMAGE)]


def test_select_after_an_image(engine, oracle):
    choices = ["cat", "dog", "a small bird"]
    state = image_pick.run(image=IMAGE, backend=engine)
    assert state.error() is None
    scores = oracle.choice_scores(oracle.prompt("Is it a cat or a dog?"), IMAGE, choices)
    assert state["animal"] == choices[max(range(3), key=scores.__getitem__)]
    assert state.get_meta_info("animal")["normalized_prompt_logprobs"] == pytest.approx(scores, abs=2e-4)


# ----- the OpenAI-compatible server, through the official client -----

def chat_messages(url: str = DATA_URL) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def test_openai_chat_with_an_image(live, oracle):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    expected = oracle.greedy_text(oracle.prompt(QUESTION), IMAGE)
    first = client.chat.completions.create(model=live.model, messages=chat_messages(), max_tokens=MAX, temperature=0)
    assert first.choices[0].message.content == expected
    second = client.chat.completions.create(model=live.model, messages=chat_messages(), max_tokens=MAX, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1  # image included
    chunks = client.chat.completions.create(model=live.model, messages=chat_messages(), max_tokens=MAX,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "only data URLs"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "could not be decoded"),
    ("data:image/png;base64," + base64.b64encode(png_bytes(sample_image(5, (300, 200)))).decode(),
     "max_image_pixels"),
])
def test_openai_bad_images_are_400(live, url, message):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=live.model, messages=chat_messages(url), max_tokens=2)
    live.engine.check_invariants()  # nothing leaked


def test_native_generate_with_image_data(live, oracle):
    body = {"text": oracle.prompt(QUESTION), "image_data": DATA_URL,
            "sampling_params": {"max_new_tokens": MAX, "temperature": 0, "stop_token_ids": sorted(oracle.stops)}}
    out = httpx.post(live.url + "/generate", json=body, timeout=60).json()
    assert out["text"] == oracle.greedy_text(oracle.prompt(QUESTION), IMAGE)
    info = httpx.get(live.url + "/get_model_info").json()
    assert info["image_token"] == "<image>" and info["tokens_per_image"] == 16


# ----- LangChain -----

IMAGE_BLOCKS = [
    {"type": "image_url", "image_url": {"url": DATA_URL}},
    {"type": "image", "base64": base64.b64encode(PNG).decode(), "mime_type": "image/png"},
    {"type": "image", "source_type": "base64", "data": base64.b64encode(PNG).decode(), "mime_type": "image/png"},
]


@pytest.mark.parametrize("where", ["engine", "server"])
def test_chat_sglang_image_blocks(engine, live, oracle, where):
    from radixlm.adapters.langchain import ChatSGLang

    target = {"engine": engine} if where == "engine" else {"base_url": live.url}
    llm = ChatSGLang(**target, temperature=0, max_tokens=MAX)
    expected = oracle.greedy_text(oracle.prompt(QUESTION), IMAGE)
    for block in IMAGE_BLOCKS:
        reply = llm.invoke([HumanMessage([block, {"type": "text", "text": QUESTION}])])
        assert reply.content == expected
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 16
    with pytest.raises(ValueError, match="does not fetch"):
        llm.invoke([HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])])


def _langchain_suite():
    from langchain_tests.integration_tests import ChatModelIntegrationTests

    from radixlm.adapters.langchain import ChatSGLang

    class VisionSuite(ChatModelIntegrationTests):
        """langchain-tests' integration suite, of which this module runs the image tests."""

        chat_model_class = ChatSGLang

        @property
        def supports_image_inputs(self) -> bool:
            return True

        @property
        def supports_image_urls(self) -> bool:
            return False  # radixlm fetches nothing: images travel as data

        @property
        def supports_image_tool_message(self) -> bool:
            return True

    return VisionSuite()


def _serve_the_suites_image(monkeypatch) -> None:
    """langchain-tests downloads its test image with httpx.get; offline, the same call returns a PNG
    made here (the download is the test's input, not what it tests)."""
    real_get = httpx.get

    def get(url, *args, **kwargs):
        if "raw.githubusercontent.com" in str(url):
            return httpx.Response(200, content=png_bytes(sample_image(6, (120, 90))), request=httpx.Request("GET", url))
        return real_get(url, *args, **kwargs)

    monkeypatch.setattr(httpx, "get", get)


def test_langchain_standard_image_inputs(engine, monkeypatch):
    from radixlm.adapters.langchain import ChatSGLang

    _serve_the_suites_image(monkeypatch)
    suite = _langchain_suite()
    model = ChatSGLang(engine=engine, temperature=0, max_tokens=MAX)
    suite.test_image_inputs(model)
    suite.test_image_tool_message(model)


# ----- DSPy -----

def test_dspy_image_field(engine, oracle):
    import dspy

    from radixlm.adapters.dspy import SGLangLM

    describe = dspy.Predict(dspy.Signature("picture: dspy.Image -> answer: str", "Describe the picture."))
    # Short fields (max_field_chars), so that the adapter's format completes within max_tokens.
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=80, max_field_chars=4, cache=False)
    usage = []
    with dspy.context(lm=lm):
        for image in (IMAGE, IMAGE, OTHER_IMAGE):
            url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
            before = len(lm.history)
            result = describe(picture=dspy.Image(url))
            assert len(lm.history) == before + 1  # one call: the reply parsed
            assert isinstance(result.answer, str)
            usage.append(lm.history[-1]["usage"])
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    # The image took its 16 positions; the same image came from the cache, another one did not.
    rendered = _rendered_without_image(oracle, lm.history[-3]["messages"])
    assert usage[0]["prompt_tokens"] == len(oracle.tok(rendered, add_special_tokens=False)["input_ids"]) + 16 - 1
    before_image = len(oracle.tok(rendered.split("<image>")[0], add_special_tokens=False)["input_ids"])
    assert cached[1] >= usage[1]["prompt_tokens"] - 1 > before_image + 16
    assert cached[2] == before_image


def _rendered_without_image(oracle: Oracle, messages: list[dict]) -> str:
    """A call's prompt as the chat template renders it, its image as the placeholder token."""
    turns = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p["text"] if p["type"] == "text" else "<image>" for p in content)
        turns.append({"role": m["role"], "content": content})
    return oracle.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def test_video_is_refused(engine):
    with pytest.raises(sgl.ProgramError, match="decodes no video files"):
        sgl.video("clip.mp4", num_frames=8)

    @sgl.function
    def describe(s):
        s += sgl.user(sgl.video([IMAGE, OTHER_IMAGE]) + "What happens?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=2))

    state = describe.run(backend=engine)
    assert isinstance(state.error(), sgl.ProgramError) and "takes no video" in str(state.error())
    with pytest.raises(InvalidRequestError, match="takes no video"):
        engine.generate("<image>hi", {"max_new_tokens": 1}, image_data=IMAGE, video_data=[IMAGE, IMAGE])
