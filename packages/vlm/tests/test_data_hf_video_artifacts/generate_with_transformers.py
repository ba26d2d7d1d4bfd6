"""Write ``reference.npz``: transformers' own video processors on the synthetic videos of
``test_video_processing.py`` (run where torchvision is importable, see README.md).

    PYTHONPATH=<dir with torchvision> python generate_with_transformers.py [out.npz]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import transformers
from transformers import LlavaOnevisionVideoProcessor, Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

HERE = Path(__file__).parent


def _cases():
    spec = importlib.util.spec_from_file_location("cases", HERE.parent / "test_video_processing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out: Path) -> None:
    import torchvision

    m = _cases()
    arrays: dict[str, np.ndarray] = {}
    for name, case in m.QWEN3_CASES.items():
        lo, hi = case["size"]
        hf = Qwen3VLVideoProcessor(
            patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
            image_std=[0.5] * 3, size={"shortest_edge": lo, "longest_edge": hi},
            min_frames=4, max_frames=768, max_video_tokens=case.get("max_video_tokens", 768),
        )  # fmt: skip
        frames = m.case_frames(*case["video"])
        meta = VideoMetadata(total_num_frames=len(frames), fps=case["video_fps"])
        # The processor's own fps (2) would clash with num_frames: sampling by count says None.
        got = hf(videos=[frames], video_metadata=[meta], return_metadata=True,
                 cap_pixels_per_frame=case.get("cap", False), return_tensors="pt",
                 **{"fps": None, **case["sample"]})  # fmt: skip
        arrays[f"qwen3/{name}/indices"] = np.asarray(got["video_metadata"][0].frames_indices)
        arrays[f"qwen3/{name}/grid"] = got["video_grid_thw"].numpy()
        arrays[f"qwen3/{name}/pixel_values_videos"] = got["pixel_values_videos"].numpy()
    for name, case in m.LLAVA_CASES.items():
        hf = LlavaOnevisionVideoProcessor(size={"height": m.LLAVA_CROP, "width": m.LLAVA_CROP})
        frames = m.case_frames(*case["video"])
        kwargs = {"do_sample_frames": bool(case["sample"]), **case["sample"]}
        if case["sample"]:
            kwargs["video_metadata"] = [
                VideoMetadata(total_num_frames=len(frames), fps=case["video_fps"])
            ]
        got = hf(videos=[frames], return_metadata=True, return_tensors="pt", **kwargs)
        indices = got["video_metadata"][0].frames_indices if case["sample"] else range(len(frames))
        arrays[f"llava/{name}/indices"] = np.asarray(list(indices))
        arrays[f"llava/{name}/pixel_values_videos"] = got["pixel_values_videos"][0].numpy()
    np.savez_compressed(out, **arrays)
    print(f"transformers {transformers.__version__}, torchvision {torchvision.__version__}: {out}")
    for key, value in arrays.items():
        print(f"  {key}: {value.shape} {value.dtype}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "reference.npz")
