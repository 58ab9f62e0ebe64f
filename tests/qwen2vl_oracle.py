"""The oracle of the Qwen2-VL tests: transformers' Qwen2VLForConditionalGeneration and image processor on
the tiny checkpoint. (Qwen2VLProcessor needs torchvision for its video processor; its text side, done
here, widens each <|image_pad|> to grid.prod() / 4 copies and marks them in mm_token_type_ids.)"""

from __future__ import annotations

import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

from radixlm.testing.vision import QWEN2_VL_IMAGE


class Qwen2VLOracle:
    def __init__(self, path: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        self.stops = {self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")}

    def inputs(self, prompt: str, images) -> dict:
        inputs = dict(self.image_processor(images=images, return_tensors="pt"))
        pieces = prompt.split("<|image_pad|>")
        text = pieces[0]
        for grid, piece in zip(inputs["image_grid_thw"], pieces[1:]):
            text += "<|image_pad|>" * (int(grid.prod()) // 4) + piece
        ids = self.tok(text, return_tensors="pt")["input_ids"]
        return {**inputs, "input_ids": ids, "mm_token_type_ids": (ids == self.model.config.image_token_id).int()}

    def prompt(self, question: str, images: int = 1) -> str:
        """A one-turn chat prompt with the images before the question, as Qwen2-VL's template puts them."""
        return self.tok.apply_chat_template([{"role": "user", "content": QWEN2_VL_IMAGE * images + question}],
                                            tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def logprobs(self, prompt: str, images) -> tuple[list[int], torch.Tensor]:
        """The expanded prompt ids and the log-softmax after each position."""
        inputs = self.inputs(prompt, images)
        logits = self.model(**inputs).logits[0].float()
        return inputs["input_ids"][0].tolist(), torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def greedy(self, prompt: str, images, n: int) -> list[int]:
        inputs = self.inputs(prompt, images)
        out = self.model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    def greedy_text(self, prompt: str, images, n: int) -> str:
        """The greedy continuation's text up to the first stop token."""
        ids = self.greedy(prompt, images, n)
        cut = next((i for i, t in enumerate(ids) if t in self.stops), len(ids))
        return self.tok.decode(ids[:cut], skip_special_tokens=True)

    @torch.no_grad()
    def choice_scores(self, prompt: str, images, choices: list[str]) -> list[float]:
        """Mean logprob of each choice's tokens after the prompt (what select's default method ranks)."""
        n_prompt = self.inputs(prompt, images)["input_ids"].shape[1]
        scores = []
        for choice in choices:
            inputs = self.inputs(prompt + choice, images)
            ids = inputs["input_ids"][0]
            logprobs = torch.log_softmax(self.model(**inputs).logits[0].float(), -1)
            picked = [logprobs[p - 1, ids[p]].item() for p in range(n_prompt, len(ids))]
            scores.append(sum(picked) / len(picked))
        return scores


def video_patches(image_processor, frames) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' image processor applied to each frame, frames paired into temporal patches (the
    layout of Qwen2-VL's video processor: [t, h*w patches, channels, temporal, p, p] flattened)."""
    out = [image_processor(images=frame, return_tensors="pt") for frame in frames]
    t_h_w = out[0]["image_grid_thw"][0]
    per_frame = torch.stack([o["pixel_values"].view(int(t_h_w.prod()), 3, 2, 14, 14)[:, :, 0] for o in out])
    pairs = per_frame.view(len(frames) // 2, 2, *per_frame.shape[1:]).permute(0, 2, 3, 1, 4, 5)
    grid = torch.tensor([[len(frames) // 2, int(t_h_w[1]), int(t_h_w[2])]])
    return pairs.reshape(-1, 3 * 2 * 14 * 14), grid


def video_inputs(oracle: Qwen2VLOracle, prompt: str, frames) -> dict:
    """The oracle's inputs for a prompt with one <|video_pad|> and the video's frames."""
    pixels, grid = video_patches(oracle.image_processor, frames)
    text = prompt.replace("<|video_pad|>", "<|video_pad|>" * (int(grid.prod()) // 4))
    ids = oracle.tok(text, return_tensors="pt")["input_ids"]
    types = (ids == oracle.model.config.video_token_id).int() * 2
    return {"input_ids": ids, "pixel_values_videos": pixels, "video_grid_thw": grid, "mm_token_type_ids": types}
