"""The data formats VLM training sets already come in, converted to this project's JSONL (docs/DATA.md).

- `llava`: LLaVA's `{"id", "image", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`
  (llava.py), in a JSON array or one a line;
- `sharegpt`: ShareGPT / LLaMA-Factory's `conversations` (from/value) or `messages` (role/content) with
  `images`, `videos` and a `system` field (sharegpt.py), in a JSON array or one a line;
- `parquet`: Hugging Face `datasets` parquet with images stored as bytes (parquet.py).

`convert_file` writes a converted file with a report (`mindvl data convert`, convert.py); `SourceRecords`
applies the same converters as the loader reads a data source with `format:` (source.py). What they share
(record and error types, roles, image headers, the output record) is in common.py; reading JSON inputs
in files.py; the formats by name and `--from auto` in detect.py.
"""
from mindvl_ms.data.formats.common import ConvertError, Record, Target
from mindvl_ms.data.formats.convert import convert_file, format_convert_report
from mindvl_ms.data.formats.detect import CONVERTERS, detect_format
from mindvl_ms.data.formats.source import SourceRecords, loader_image_dir

__all__ = ["ConvertError", "Record", "Target", "convert_file", "format_convert_report", "CONVERTERS",
           "detect_format", "SourceRecords", "loader_image_dir"]
