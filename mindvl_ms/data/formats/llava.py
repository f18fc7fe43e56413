"""LLaVA records: `{"id", "image": "x.jpg" or a list, "conversations": [{"from": "human", "value":
"<image>\\n..."}, {"from": "gpt", "value": ...}]}`, in a JSON array or one a line.

Roles human/gpt/system become user/assistant/system; LLaVA's `<image>` in the text is this project's
placeholder and stays where it is (one per image, in order); `image` may also be spelled `images`.
"""
from __future__ import annotations

from typing import Any, Dict

from mindvl_ms.data.formats.common import ConvertError, Target, media, project_record, turns

KNOWN = ("conversations", "image", "images")


def llava_record(obj: Any, target: Target) -> Dict[str, Any]:
    """One LLaVA record -> one record of this project's JSONL (raises ConvertError)."""
    if not isinstance(obj, dict):
        raise ConvertError("schema", f"expected a JSON object, got {type(obj).__name__}")
    if "conversations" not in obj:
        raise ConvertError("no conversation", f"no field 'conversations' (a LLaVA record is {{id, image, "
                                              f"conversations: [{{from, value}}]}}; fields: {', '.join(sorted(obj))})")
    messages = turns(obj["conversations"], "conversations")
    return project_record(messages, media(obj, ("image", "images"), target), target, obj, KNOWN)
