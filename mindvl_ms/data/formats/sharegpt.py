"""ShareGPT / LLaMA-Factory records: `{"conversations": [{"from", "value"}]}` or `{"messages": [{"role",
"content"}]}`, with `images` (and `videos`) lists, `<image>` tokens in the text and an optional `system`
field, in a JSON array or one a line. This project's own JSONL reads as this format too.

LLaMA-Factory's `system` field becomes the first (system) turn; a record with both that field and a
system turn is not converted (the two would disagree about the prompt).
"""
from __future__ import annotations

from typing import Any, Dict

from mindvl_ms.data.formats.common import ConvertError, Target, media, project_record, turns

KNOWN = ("messages", "conversations", "images", "image", "videos", "system", "image_sizes")


def sharegpt_record(obj: Any, target: Target) -> Dict[str, Any]:
    """One ShareGPT record -> one record of this project's JSONL (raises ConvertError)."""
    if not isinstance(obj, dict):
        raise ConvertError("schema", f"expected a JSON object, got {type(obj).__name__}")
    key = "messages" if "messages" in obj else "conversations"
    if key not in obj:
        raise ConvertError("no conversation", f"no field 'messages' or 'conversations' (fields: "
                                              f"{', '.join(sorted(obj))})")
    messages = turns(obj[key], key)
    system = obj.get("system")
    if system is not None and system != "":
        if not isinstance(system, str):
            raise ConvertError("schema", f"field system: expected a string, got {type(system).__name__}")
        if messages[0]["role"] == "system":
            raise ConvertError("schema", f"both a 'system' field and a system turn ({key}[0])")
        messages.insert(0, {"role": "system", "content": system})
    return project_record(messages, media(obj, ("images", "image"), target), target, obj, KNOWN,
                          videos=media(obj, ("videos",), target))
