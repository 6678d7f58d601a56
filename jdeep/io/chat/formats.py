"""DeepSeek-V4 and V4.1 chat formats: the special tokens, the DSML tag names and the reasoning-effort lines each
version's own encoder (`encoding/encoding_dsv4.py` published with V4, the V4.1 encoder published with V4.1) writes.

What differs between the two (and nothing else does):
- V4.1 opens a system message with `<｜System｜>` (V4 writes its text bare after BOS), and a system message after
  the first counts as a user turn (it gets the `<｜Assistant｜>` generation header after it).
- DSML tag names: V4 `<｜DSML｜tool_calls>` / `invoke` / `parameter`; V4.1 puts a space before each name
  (`<｜DSML｜ calls>`, `<｜DSML｜ invoke`, `<｜DSML｜ parameter`).
- Reasoning effort (thinking mode only, before the first message): V4 writes a fixed paragraph for "max" and
  nothing for "high" or none; V4.1 writes `Reasoning Effort: N (range 1-100, ...)` for N in [1, 100] or a name
  (low 25, high 50, xhigh 75, max 100), "high" when none is given, inside the leading `<｜System｜>`.
- V4.1 replaces image content parts with `<｜deepseek_image｜>` and refuses that token in text; V4 has no images.
- Tool-call arguments that are not a JSON object: V4 wraps them as {"arguments": <the text>}, V4.1 refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChatFormat", "V4", "V41", "FORMATS", "chat_format_for", "BOS", "EOS", "USER", "ASSISTANT", "SYSTEM",
           "THINK", "END_THINK", "DSML", "LATEST_REMINDER", "IMAGE"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"

_V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
_V41_EFFORT_NAMES = {"low": 25, "high": 50, "xhigh": 75, "max": 100}


@dataclass(frozen=True)
class ChatFormat:
    """One version's chat layout. calls / invoke / parameter: the DSML tag names (after `｜DSML｜`)."""

    name: str                       # "v4" or "v41"
    calls: str
    invoke: str
    parameter: str
    system_token: str               # "" for V4
    images: bool                    # image parts become IMAGE placeholders

    # ------------------------------------------------------------------ tags
    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls}>"

    @property
    def calls_close(self) -> str:
        return f"</{DSML}{self.calls}>"

    @property
    def invoke_open(self) -> str:
        return f"<{DSML}{self.invoke}"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def parameter_open(self) -> str:
        return f"<{DSML}{self.parameter}"

    @property
    def parameter_close(self) -> str:
        return f"</{DSML}{self.parameter}>"

    @property
    def tool_calls_start(self) -> str:
        """What begins a reply's tool calls: a blank line, then the calls block."""
        return "\n\n" + self.calls_open

    # ------------------------------------------------------------------ reasoning effort
    def effort_values(self) -> str:
        return ("'high' or 'max'" if self.name == "v4" else
                "an integer in [1, 100] or one of " + ", ".join(repr(k) for k in _V41_EFFORT_NAMES))

    def check_effort(self, effort) -> None:
        """ValueError unless `effort` (None = the format's default) is one this format defines."""
        if effort is None:
            return
        ok = (effort in ("high", "max") if self.name == "v4" else
              (type(effort) is int and 1 <= effort <= 100) or (isinstance(effort, str) and effort in _V41_EFFORT_NAMES))
        if not ok:
            raise ValueError(f"reasoning_effort must be {self.effort_values()} for DeepSeek-{self.name.upper()}, "
                             f"got {effort!r}")

    def effort_line(self, effort) -> str:
        """The text thinking mode puts before the first message ('' for none)."""
        self.check_effort(effort)
        if self.name == "v4":
            return _V4_MAX_EFFORT if effort == "max" else ""
        budget = _V41_EFFORT_NAMES[effort or "high"] if not isinstance(effort, int) else effort
        return f"Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


V4 = ChatFormat("v4", "tool_calls", "invoke", "parameter", system_token="", images=False)
V41 = ChatFormat("v41", " calls", " invoke", " parameter", system_token=SYSTEM, images=True)
FORMATS = {"v4": V4, "v41": V41}


def chat_format_for(model_type: str, override: str | None = None) -> ChatFormat:
    """The chat format of a model: `override` ("v4" / "v41") if given, else from its config's model_type
    ("deepseek_v41" -> V4.1, any other DeepSeek-V4 type -> V4)."""
    if override is not None:
        if override not in FORMATS:
            raise ValueError(f"chat format must be one of {sorted(FORMATS)}, got {override!r}")
        return FORMATS[override]
    return V41 if model_type == "deepseek_v41" else V4
