"""Only the frames a sample needs are decoded; decoders are cached in a bounded LRU."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from longboat.embodied.data import LeRobotDataset, PyAVDecoder, write_synthetic_dataset
from longboat.embodied.data.video_decode import resolve_backend, torchcodec_available

FPS, GOP, LENGTH = 10, 6, 20


class _CountingContainer:
    """Wraps a PyAV container and counts every frame its decode() hands out."""

    def __init__(self, container, counter: list[int]) -> None:
        self._c, self._counter = container, counter

    def decode(self, *args, **kwargs):
        for frame in self._c.decode(*args, **kwargs):
            self._counter[0] += 1
            yield frame

    def __getattr__(self, name):
        return getattr(self._c, name)


def counting_backend(counter: list[int]):
    def factory(path: Path) -> PyAVDecoder:
        dec = PyAVDecoder(path)
        dec._container = _CountingContainer(dec._container, counter)
        return dec

    return factory


def keyframe_times(path: Path) -> list[float]:
    """Keyframe timestamps from the packets (demux only, nothing decoded)."""
    with av.open(str(path)) as c:
        st = c.streams.video[0]
        return [
            float(p.pts * st.time_base) for p in c.demux(st) if p.pts is not None and p.is_keyframe
        ]


@pytest.fixture(scope="module", params=["v2.1", "v3.0"])
def root(request, tmp_path_factory):
    (path,) = write_synthetic_dataset(
        tmp_path_factory.mktemp(request.param),
        layout=request.param,
        num_episodes=3,
        episode_length=(LENGTH, LENGTH),
        fps=FPS,
        cameras=("front",),
        gop=GOP,
    )
    return path


def test_decodes_from_previous_keyframe_only(root):
    counter = [0]
    ds = LeRobotDataset(root, video_backend=counting_backend(counter), image_dtype="uint8")
    key = "observation.images.front"
    total = 0
    for pos in range(len(ds)):
        ep = ds.episodes[int(ds._row_episode[pos])]
        f = pos - ds.episode_ranges[ep.index][0]
        span = ep.videos[key]
        target = span.from_timestamp + f / FPS
        kf = max(t for t in keyframe_times(span.path) if t <= target + 1e-9)
        before = counter[0]
        ds[pos]
        decoded = counter[0] - before
        # Exactly the frames from the keyframe at or before the target up to the target.
        assert decoded == round((target - kf) * FPS) + 1, (pos, target, kf)
        assert decoded <= GOP
        total += decoded
    # Decoding whole episodes would cost LENGTH frames per sample.
    assert total < len(ds) * LENGTH / 3
    assert ds.frames_decoded == counter[0] == total


def test_chunked_deltas_decode_one_run(root):
    counter = [0]
    deltas = [-0.3, -0.2, -0.1, 0.0]
    ds = LeRobotDataset(
        root,
        video_backend=counting_backend(counter),
        delta_timestamps={"observation.images.front": deltas},
    )
    start, _ = ds.episode_ranges[1]
    ds[start + 10]
    # Frames 7..10 of the episode; the run starts at the keyframe at or before frame 7.
    ep = ds.episodes[1]
    span = ep.videos["observation.images.front"]
    first = span.from_timestamp + 0.7
    kf = max(t for t in keyframe_times(span.path) if t <= first + 1e-9)
    assert counter[0] == round((first - kf) * FPS) + 4


def test_decoder_cache_is_bounded_lru(tmp_path):
    (path,) = write_synthetic_dataset(
        tmp_path, layout="v2.1", num_episodes=3, episode_length=(5, 5), cameras=("a", "b")
    )
    ds = LeRobotDataset(path, max_open_decoders=2)
    for pos in range(len(ds)):
        ds[pos]
        assert len(ds.decoders) <= 2
    assert ds.decoders.opened == 6  # each (episode, camera) file opened once, in order
    ds[len(ds) - 1]
    assert ds.decoders.opened == 6  # last file still cached: no reopen
    with pytest.raises(ValueError, match="max_open_decoders=0"):
        LeRobotDataset(path, max_open_decoders=0)


def test_backend_selection():
    assert resolve_backend("pyav") is PyAVDecoder
    with pytest.raises(ValueError, match="video_backend='ffmpeg'"):
        resolve_backend("ffmpeg")
    if torchcodec_available():
        from longboat.embodied.data import TorchCodecDecoder

        assert resolve_backend("auto") is TorchCodecDecoder
    else:
        assert resolve_backend("auto") is PyAVDecoder
        with pytest.raises(ValueError, match=r"longboat-embodied\[torchcodec\]"):
            resolve_backend("torchcodec")


def test_torchcodec_matches_pyav(root):
    pytest.importorskip("torchcodec")
    a = LeRobotDataset(root, video_backend="pyav", image_dtype="uint8")
    b = LeRobotDataset(root, video_backend="torchcodec", image_dtype="uint8")
    for pos in (0, 7, len(a) - 1):
        diff = a[pos]["observation.images.front"].int() - b[pos]["observation.images.front"].int()
        assert np.abs(diff.numpy()).max() <= 2


@pytest.mark.multiprocess
def test_dataloader_workers_decode_same_frames(tmp_path):
    """Forked DataLoader workers open their own decoders and return the frames read in-process."""
    import torch

    (path,) = write_synthetic_dataset(
        tmp_path, layout="v3.0", num_episodes=2, episode_length=(8, 8)
    )
    ds = LeRobotDataset(path, image_dtype="uint8")
    ds[3]  # the parent opens a decoder before forking; workers must not reuse it
    ref = torch.stack([ds[i]["observation.images.wrist"] for i in range(len(ds))])
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, timeout=60)
    got = torch.cat([b["observation.images.wrist"] for b in loader])
    assert torch.equal(got, ref)


def test_torchcodec_adapter_with_stand_in(root, monkeypatch):
    """TorchCodecDecoder's contract (shape, tolerance check) against a PyAV-backed stand-in
    of ``torchcodec.decoders.VideoDecoder`` (torchcodec is the optional ``torchcodec`` extra, outside the test environment)."""
    import importlib.machinery
    import sys
    import types

    import torch

    from longboat.embodied.data import TorchCodecDecoder, VideoDecodeError

    class FakeVideoDecoder:
        def __init__(self, source, seek_mode="exact"):
            assert seek_mode == "approximate"
            self._dec = PyAVDecoder(source)
            self.shift = 0.0

        def get_frames_played_at(self, seconds):
            data = self._dec.get_frames(seconds, 1e-4)
            pts = torch.tensor([s + self.shift for s in seconds], dtype=torch.float64)
            return types.SimpleNamespace(data=data, pts_seconds=pts)

    pkg = types.ModuleType("torchcodec")
    pkg.__spec__ = importlib.machinery.ModuleSpec("torchcodec", None)
    sub = types.ModuleType("torchcodec.decoders")
    sub.VideoDecoder = FakeVideoDecoder
    monkeypatch.setitem(sys.modules, "torchcodec", pkg)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", sub)
    assert resolve_backend("auto") is TorchCodecDecoder

    via_tc = LeRobotDataset(root, video_backend="torchcodec", image_dtype="uint8")
    via_av = LeRobotDataset(root, video_backend="pyav", image_dtype="uint8")
    key = "observation.images.front"
    for pos in (0, 9, len(via_av) - 1):
        assert torch.equal(via_tc[pos][key], via_av[pos][key])
    assert via_tc.frames_decoded == 3  # torchcodec reports returned frames only

    dec = TorchCodecDecoder(via_av.episodes[0].videos[key].path)
    dec._decoder.shift = 0.01  # the backend answered with a frame 10 ms away
    with pytest.raises(VideoDecodeError, match=r"has pts 0.010000s, beyond tolerance"):
        dec.get_frames([0.0], 1e-4)


def test_seek_that_lands_past_the_target_falls_back(root):
    """A demuxer that seeks past the wanted time must not yield a wrong frame."""
    counter = [0]

    class _OvershootingContainer(_CountingContainer):
        def seek(self, offset, **kwargs):
            if offset > 0:  # land one second late, on any frame
                kwargs["any_frame"] = True
                offset += int(1 / self._c.streams.video[0].time_base)
            return self._c.seek(offset, **kwargs)

    def factory(path):
        dec = PyAVDecoder(path)
        dec._container = _OvershootingContainer(dec._container, counter)
        return dec

    good = LeRobotDataset(root, image_dtype="uint8")
    bad = LeRobotDataset(root, image_dtype="uint8", video_backend=factory)
    key = "observation.images.front"
    for pos in (3, 12, len(good) - 5):
        import torch

        assert torch.equal(bad[pos][key], good[pos][key])
