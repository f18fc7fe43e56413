"""The special token strings of the Qwen2.5-VL chat template and vision tags, and the label of unsupervised
positions.

Every `<image>` placeholder of a sample becomes `<|vision_start|><|image_pad|>*N<|vision_end|>` (one pad per
merged visual token), every `<video>` the same with `<|video_pad|>`; a turn is
`<|im_start|>role\\n...<|im_end|>\\n`. The processor, the chat template written into checkpoints, the
vocabulary subset and the validator all spell these tokens from here.
"""
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
ENDOFTEXT = "<|endoftext|>"

IMAGE_TAG = VISION_START + IMAGE_PAD + VISION_END  # what one <image> placeholder renders as (before expansion)
VIDEO_TAG = VISION_START + VIDEO_PAD + VISION_END

CHAT_TOKENS = (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, IM_START, IM_END)  # a processor needs them all
VISION_TOKENS = (IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD)  # raw in a sample's text they are an error

IGNORE_INDEX = -100  # the label of a position that is not supervised (HF convention)
