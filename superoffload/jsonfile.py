"""One JSON object read from a file's text, the errors naming the file (a broken file
or a JSON list used to give a bare decoder message or a raw traceback).

The one reader of the configs people hand us as JSON: a DeepSpeed config (ds_keys.read), a
Hugging Face config.json (plan/hf_config.load_config) and a profile (``plan --profile``). A leaf
module: it imports nothing of ours, so the planner may use it.
"""

from __future__ import annotations

import json
from typing import Any


def parse_object(text: str, where: str, *, hint: str = "",
                 error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object `text` holds. `error` (a ValueError) when it is not valid JSON or not
    an object, starting with `where` (the file) and ending with `hint` (what to pass)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                    f"{exc.colno}){hint}") from None
    if not isinstance(data, dict):
        raise error(f"{where}: holds a JSON {type(data).__name__}, not an object{hint}")
    return data
