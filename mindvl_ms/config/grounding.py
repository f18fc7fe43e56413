"""`data.grounding:` section: how grounding coordinates are written in sample text (mindvl_ms/data/grounding.py).

The processor writes every point/box/quad label of a sample in `coord_format` before tokenizing (training
text and inference prompts alike; parsing reads every format), and a checkpoint records the format in its
processor files, so serving it writes prompts as it was trained. The default, zero-padded three-digit
numbers ("008"), is the openPangu-VL report's finding (section 5.2.3, Observation 2: "Using normalized
coordinates formatted as "008" rather than "8" yields slightly higher scores"), and it is this project's
recipes' format. A checkpoint that records no format (a converted Hugging Face model such as Qwen2.5-VL,
or one written before the option) keeps its own plain numbers: `RECORDLESS_COORD_FORMAT`.
"""
from __future__ import annotations

from dataclasses import dataclass

from mindvl_ms.config.base import ConfigError, F

COORD_FORMATS = ("zero_pad", "plain", "digits")  # "008", "8", "0 0 8"
RECORDLESS_COORD_FORMAT = "plain"  # the format of a checkpoint whose processor files record none


@dataclass
class GroundingConfig:
    """Grounding coordinate format of sample text."""

    coord_format: str = F("zero_pad", "zero_pad (`008`: three digits, the openPangu-VL report's better format), "
                                      "plain (`8`) or digits (`0 0 8`): how the processor writes the "
                                      "coordinates of point/box/quad labels before tokenizing; every format "
                                      "is read")

    def validate(self) -> None:
        if self.coord_format not in COORD_FORMATS:
            raise ConfigError(f"coord_format '{self.coord_format}': expected one of {', '.join(COORD_FORMATS)}")
