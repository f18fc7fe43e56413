"""Small test videos written with PyAV (lossless ffv1 in .mkv, so decoded pixels equal what was written)."""
import numpy as np

from tests.support.data import write_images


def frame_pixels(i: int, width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3]: a gradient whose colour changes with the frame index, and a moving square."""
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)),
                    np.full_like(x, (i * 37) % 256)], -1).astype(np.uint8)
    s = max(4, min(width, height) // 4)
    x0 = (i * 5) % max(width - s, 1)
    img[height // 3: height // 3 + s, x0: x0 + s] = (255, 255, 255)
    return img


def write_video(path, frames: int = 30, fps: int = 10, width: int = 96, height: int = 64) -> np.ndarray:
    """Write a lossless video; returns the frames uint8 [frames, height, width, 3]."""
    import av

    data = np.stack([frame_pixels(i, width, height) for i in range(frames)])
    with av.open(str(path), "w") as c:
        s = c.add_stream("ffv1", rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "bgr0"
        for arr in data:
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return data


def write_mixed_media(d) -> None:
    """The mixed-media fixture tests share: the `write_images` set under d/img plus two clips, a.mkv (30 frames
    at 10 fps, 96x64) and b.mkv (12 frames at 6 fps, 64x64)."""
    write_images(str(d / "img"))
    write_video(d / "a.mkv", frames=30, fps=10, width=96, height=64)
    write_video(d / "b.mkv", frames=12, fps=6, width=64, height=64)
