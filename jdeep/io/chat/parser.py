"""A reply's text -> reasoning, content and tool calls, incrementally (the reasoning and tool-call parsers of a
DeepSeek-V4 / V4.1 chat server).

The reply is the text after the prompt, decoded with special tokens kept:

    thinking mode:  {reasoning}</think>{content}[\\n\\n<DSML calls block>]<｜end▁of▁sentence｜>
    chat mode:                         {content}[\\n\\n<DSML calls block>]<｜end▁of▁sentence｜>

`ReplyParser.push(text)` returns the events the new text completes: ("reasoning", text), ("content", text),
("call", index, name) when an invoke's name is read, ("arguments", index, piece) per parameter and at the invoke's
end (a call's pieces concatenate to DeepSeek's decoded JSON arguments, dsml.argument_piece); `finish()` flushes.
Text that could still be the start of a marker is held back until it is decided, so markup never reaches
`content` or `reasoning`: `</think>`, `<think>`, EOS and the calls block are consumed, not shown.

On well-formed replies the result equals DeepSeek's `parse_message_from_completion_text`. Beyond it (its README
says it handles well-formed output only), the parser accepts: a thinking reply without `</think>` (all reasoning,
or reasoning up to a calls block), whitespace variations inside the DSML tags, text after a calls block (more
content, or another block), and a reply cut off inside a call (the call is closed with the parameters read so
far). Text inside a calls block that is not DSML is dropped.
"""

from __future__ import annotations

import re

from .dsml import ARGUMENTS_CLOSE, argument_piece
from .formats import DSML, END_THINK, EOS, THINK, ChatFormat

__all__ = ["ReplyParser", "parse_reply"]


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class _Calls:
    """The inside of one DSML calls block, parsed unit by unit (invoke header, parameter, invoke end, block end)."""

    def __init__(self, fmt: ChatFormat):
        q = re.escape
        self.header = re.compile(r"\s*" + q(fmt.invoke_open) + r'\s+name="([^"]*)"\s*>')
        self.param = re.compile(r"\s*" + q(fmt.parameter_open) + r'\s+name="([^"]*)"\s+string="(true|false)"\s*>'
                                r"(.*?)" + q(fmt.parameter_close), re.DOTALL)
        self.invoke_end = re.compile(r"\s*" + q(fmt.invoke_close))
        self.block_end = re.compile(r"\s*" + q(fmt.calls_close))
        self.tags = (fmt.invoke_open, fmt.parameter_open, fmt.invoke_close, fmt.calls_close)
        self.open_call: int | None = None     # index of the call being read
        self.params: set[str] = set()

    def step(self, buf: str, n_calls: int) -> tuple[int, tuple | None, bool] | None:
        """Parse one unit at the start of buf: (characters consumed, event or None, block ended); None if buf
        does not hold a whole unit yet."""
        if buf.startswith(">"):       # the rest of the `<DSML calls` opening tag
            return 1, None, False
        m = self.block_end.match(buf)
        if m:
            ev = self._close()
            return m.end(), ev, True
        if self.open_call is None:
            m = self.header.match(buf)
            if m:
                self.open_call, self.params = n_calls, set()
                return m.end(), ("call", n_calls, m.group(1)), False
        else:
            m = self.param.match(buf)
            if m:
                name, string, value = m.groups()
                if name in self.params:                 # a repeated name: DeepSeek refuses it; keep the first
                    return m.end(), None, False
                first = not self.params
                self.params.add(name)
                return m.end(), ("arguments", self.open_call, argument_piece(first, name, value, string == "true")), \
                    False
            m = self.invoke_end.match(buf)
            if m:
                return m.end(), self._close(), False
        stripped = buf.lstrip()
        if any(stripped.startswith(t) or t.startswith(stripped) for t in self.tags):
            return None                                  # a unit (or its tag) still arriving
        lead = len(buf) - len(stripped)                  # not DSML: skip it, up to the next tag
        nxt = [p for p in (buf.find(t, lead) for t in self.tags) if p >= 0]
        n = min(nxt) if nxt else len(buf) - _held(buf, self.tags + (EOS,))
        return (n, None, False) if n > 0 else None

    def _close(self) -> tuple | None:
        if self.open_call is None:
            return None
        ev = ("arguments", self.open_call, ARGUMENTS_CLOSE if self.params else "{}")
        self.open_call = None
        return ev


class ReplyParser:
    """Incremental parser of one reply. thinking: the prompt opened the reply with `<think>`. prefix: text the
    prompt already holds of the reply (e.g. a forced calls-block opening), parsed first; its events come with
    the first push (or finish)."""

    def __init__(self, fmt: ChatFormat, thinking: bool, prefix: str = ""):
        self.fmt = fmt
        self.state = "reasoning" if thinking else "content"
        self.buf = ""
        self.n_calls = 0
        self.ended = False
        self._calls: _Calls | None = None
        self._pending: list[tuple] = []
        self._pending = self.push(prefix) if prefix else []

    def push(self, text: str) -> list[tuple]:
        """Feed the reply's next text; returns the events it completes."""
        events, self._pending = self._pending, []
        if self.ended:
            return events
        self.buf += text
        return events + self._run(final=False)

    def finish(self) -> list[tuple]:
        """The reply ended: flush what was held back (a call cut off is closed)."""
        events, self._pending = self._pending, []
        if self.ended:
            return events
        events += self._run(final=True)
        if self._calls is not None:
            ev = self._calls._close()
            events += [ev] if ev else []
        self.buf, self.ended = "", True
        return events

    def _run(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        while self.buf and not self.ended:
            before = (self.state, len(self.buf))
            if self.state == "calls":
                self._step_calls(events, final)
            else:
                self._step_text(events, final)
            if (self.state, len(self.buf)) == before:
                break
        return events

    def _step_text(self, events: list[tuple], final: bool) -> None:
        """Reasoning or content up to the next marker (a stray DSML tag is dropped whole)."""
        markers = (EOS, self.fmt.tool_calls_start, self.fmt.calls_open, THINK, END_THINK, "</" + DSML, "<" + DSML,
                   DSML)
        found = sorted((p, -len(m), m) for m in markers for p in [self.buf.find(m)] if p >= 0)
        partial = len(self.buf) - _held(self.buf, markers)      # where a marker may still be arriving
        if found and (final or found[0][0] < partial):
            pos, _, marker = found[0]
            end = pos + len(marker)
            if marker in ("</" + DSML, "<" + DSML):
                close = self.buf.find(">", end)
                if close < 0 and not final:
                    self._emit(events, self.buf[:pos])
                    self.buf = self.buf[pos:]
                    return
                end = len(self.buf) if close < 0 else close + 1
            self._emit(events, self.buf[:pos])
            self.buf = self.buf[end:]
            if marker == EOS:
                self.ended = True
            elif marker in (self.fmt.tool_calls_start, self.fmt.calls_open):
                self.state, self._calls = "calls", _Calls(self.fmt)
            elif marker == END_THINK and self.state == "reasoning":
                self.state = "content"
            return
        keep = 0 if final else _held(self.buf, markers)
        self._emit(events, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]

    def _emit(self, events: list[tuple], text: str) -> None:
        if text:
            if events and events[-1][0] == self.state:
                events[-1] = (self.state, events[-1][1] + text)
            else:
                events.append((self.state, text))

    def _step_calls(self, events: list[tuple], final: bool) -> None:
        """One unit of the calls block; at EOS (or the end of the reply) a call still open is closed."""
        eos = self.buf.find(EOS)
        region = self.buf if eos < 0 else self.buf[:eos]
        r = self._calls.step(region, self.n_calls) if region.strip() else None
        if r is None:
            if eos >= 0 or final:
                ev = self._calls._close()
                events += [ev] if ev else []
                self.buf, self.ended = "", True
            return
        n, ev, block_ended = r
        self.buf = self.buf[n:]
        if ev is not None:
            if ev[0] == "call":
                self.n_calls += 1
            events.append(ev)
        if block_ended:
            self.state, self._calls = "content", None


def parse_reply(fmt: ChatFormat, text: str, thinking: bool) -> dict:
    """A whole reply -> {"reasoning_content", "content", "tool_calls": [{"name", "arguments"}]}."""
    p = ReplyParser(fmt, thinking)
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    for ev in p.push(text) + p.finish():
        if ev[0] == "reasoning":
            out["reasoning_content"] += ev[1]
        elif ev[0] == "content":
            out["content"] += ev[1]
        elif ev[0] == "call":
            out["tool_calls"].append({"name": ev[2], "arguments": ""})
        else:
            out["tool_calls"][ev[1]]["arguments"] += ev[2]
    return out
