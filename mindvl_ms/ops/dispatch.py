"""The one place that decides which kernels to use: Ascend fused ops when the device target is Ascend."""
import mindspore as ms


def is_ascend() -> bool:
    """True when MindSpore's device target is Ascend (fused kernels available)."""
    try:
        target = ms.get_context("device_target")
    except (ValueError, RuntimeError):
        return False
    return target == "Ascend"
