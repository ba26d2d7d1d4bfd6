"""H.264 (yuv420p) mp4 encoding through PyAV, with a keyframe at every episode start.

LeRobot v3.0 concatenates per-episode mp4s into one file, so every episode starts on a
keyframe; encoding one continuous stream with a forced IDR frame at each episode start gives
the same random-access structure without a remux step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import av
import numpy as np

X264_PARAMS = "scenecut=0:asm=0"
"""libx264 settings of every synthetic video: keyframes only where forced, and the encoder's
C paths, so one process writes the same bytes for the same frames every time."""


def encode_mp4(
    path: Path,
    segments: Sequence[np.ndarray],
    fps: int,
    *,
    crf: int = 12,
    gop: int = 8,
    codec: str = "libx264",
) -> None:
    """Encode ``segments`` (each uint8 [T,H,W,3]) back to back into one h264 yuv420p mp4.

    Frame ``i`` of the whole file gets pts ``i / fps``; each segment's first frame is an IDR
    keyframe. ``gop`` bounds the distance between keyframes inside a segment (decode cost of
    a random seek); B-frames are disabled so packet order equals presentation order. The
    same frames give the same file (``X264_PARAMS``), so two runs that write the same
    synthetic dataset train on the same pixels.
    """
    if not segments:
        raise ValueError(f"{path}: nothing to encode (no segments)")
    height, width = segments[0].shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(
            f"{path}: yuv420p needs even image sizes, got {height}x{width}; use even height/width"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        stream.codec_context.max_b_frames = 0
        # scenecut=0 keeps keyframes exactly where we force them (episode starts, every gop).
        # asm=0: x264's SIMD paths do not always give the same bitstream for the same frames
        # inside a training process (2-3% of the tiny GR00T runs' encodes differed, so
        # two runs of one config decoded different pixels); its C paths do, at about 3x the
        # encode time, which only the small synthetic videos written here pay.
        stream.options = {"crf": str(crf), "forced-idr": "1", "x264-params": X264_PARAMS}
        pts = 0
        for seg in segments:
            if seg.shape[1:] != (height, width, 3) or seg.dtype != np.uint8:
                raise ValueError(
                    f"{path}: segment frames must be uint8 [T,{height},{width},3], "
                    f"got {seg.dtype} {list(seg.shape)}"
                )
            for t in range(seg.shape[0]):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(seg[t]), format="rgb24")
                frame.pts = pts
                if t == 0:
                    frame.pict_type = av.video.frame.PictureType.I
                for packet in stream.encode(frame):
                    container.mux(packet)
                pts += 1
        for packet in stream.encode():
            container.mux(packet)
