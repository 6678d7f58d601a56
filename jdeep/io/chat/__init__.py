"""DeepSeek-V4 / V4.1 chat: the prompt layout (encoding), tool-call markup (dsml) and the reply parser."""

from .chat_text import ChatText
from .encoding import encode_chat, normalize_messages
from .formats import FORMATS, V4, V41, ChatFormat, chat_format_for
from .parser import ReplyParser, parse_reply

__all__ = ["encode_chat", "normalize_messages", "ChatText", "ChatFormat", "V4", "V41", "FORMATS", "chat_format_for",
           "ReplyParser", "parse_reply"]
