"""Prompts with images (DeepSeek-V4.1): {"text": ..., "images": [...]} -> token ids with each image's span of
image_token_id positions and the tower's rows for them.

The text marks where each image goes with V4.1's placeholder `<｜deepseek_image｜>` (what the chat encoder writes
for an image content part); a text without placeholders gets its images first. The placeholder is spliced in as
config.image_token_id, not looked up in the tokenizer (DeepSeek's code does the same: its spelling differs across
tokenizer revisions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..io.chat.formats import IMAGE as IMAGE_PLACEHOLDER
from ..model.model import Model
from ..model.vision import ImageSpan
from ..vision.processor import MAX_IMAGES, ImageError
from .requests import RequestError

__all__ = ["IMAGE_PLACEHOLDER", "ImagePrompt", "expand_image_prompt", "is_image_prompt", "split_images"]


@dataclass(frozen=True)
class ImagePrompt:
    """An expanded prompt with images: ids (image spans as image_token_id runs) and spans ((start, rows)); the
    tower has run."""

    ids: tuple[int, ...]
    spans: tuple[ImageSpan, ...]

    def __len__(self) -> int:
        return len(self.ids)


def is_image_prompt(prompt: Any) -> bool:
    """Whether `prompt` is a {"text", "images"} prompt (not yet expanded)."""
    return isinstance(prompt, Mapping)


def expand_image_prompt(model: Model, prompt: Mapping, tokenizer, index: int = 0) -> ImagePrompt:
    """The ImagePrompt (token ids, [(span start, rows [n, D])]) of a {"text": str, "images": [PIL image | path |
    bytes | data URL]} prompt; RequestError naming prompt `index` for a model without a vision tower, a text without a tokenizer,
    a placeholder count that does not match the images, more than MAX_IMAGES images, or a bad image."""
    unknown = set(prompt) - {"text", "images"}
    if unknown:
        raise RequestError(f"prompt {index}: unknown keys {sorted(unknown)} (a prompt with images is "
                           "{'text': ..., 'images': [...]})", "prompt")
    text, images = prompt.get("text", ""), prompt.get("images", [])
    if not isinstance(text, str):
        raise RequestError(f"prompt {index}: text must be a string, got {type(text).__name__}", "prompt")
    if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
        raise RequestError(f"prompt {index}: images must be a list, got {type(images).__name__}", "prompt")
    if images and model.vision is None:
        raise RequestError(f"prompt {index} has images but this model has no vision tower (its config.json has no "
                           "vision_config)", "prompt")
    if len(images) > MAX_IMAGES:
        raise RequestError(f"prompt {index} has {len(images)} images; at most {MAX_IMAGES} per request", "prompt")
    if text and tokenizer is None:
        raise RequestError(f"prompt {index} is text but the model has no tokenizer (no tokenizer.json)", "prompt")
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) == 1:
        pieces = [""] * len(images) + pieces
    elif len(pieces) - 1 != len(images):
        raise RequestError(f"prompt {index}: the text has {len(pieces) - 1} image placeholders "
                           f"({IMAGE_PLACEHOLDER}) for {len(images)} images", "prompt")
    ids: list[int] = []
    spans: list[ImageSpan] = []
    for k, piece in enumerate(pieces):
        if piece:
            ids += [int(t) for t in tokenizer.encode(piece)]
        if k < len(images):
            try:
                rows = model.vision.encode(images[k])
            except ImageError as e:
                raise RequestError(f"prompt {index}, image {k}: {e}", "prompt") from None
            spans.append((len(ids), rows))
            ids += [model.config.image_token_id] * len(rows)
    if not ids:
        raise RequestError(f"prompt {index} is empty", "prompt")
    return ImagePrompt(tuple(ids), tuple(spans))


def split_images(model: Model, prompt: Any, tokenizer, refuse: str | bool = False
                 ) -> tuple[Any, tuple[ImageSpan, ...]]:
    """(the prompt as token ids or as given, its image spans): a {"text", "images"} prompt is expanded here (the
    tower runs), an ImagePrompt split; any other prompt comes back unchanged with no spans. refuse: the name of an
    engine that takes no images (a RequestError for a prompt with images)."""
    has_images = prompt.spans if isinstance(prompt, ImagePrompt) else is_image_prompt(prompt) and prompt.get("images")
    if has_images and refuse:
        raise RequestError(f"{refuse} does not take prompts with images yet", "prompt")
    if is_image_prompt(prompt):
        prompt = expand_image_prompt(model, prompt, tokenizer)
    if isinstance(prompt, ImagePrompt):
        return list(prompt.ids), prompt.spans
    return prompt, ()
