"""``write_synthetic_dataset``'s options for datasets written one embodiment at a time
(``embodiment_ids``) and for large frames (``image_stats_stride``)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from longboat.embodied.data import EmbodimentSpec, synthetic_state, write_synthetic_dataset
from longboat.embodied.data.stats import image_stats
from longboat.embodied.data.synthetic import synthetic_frame

SPEC = EmbodimentSpec(name="arm4", state_dim=4, action_dim=3)
KEY = "observation.images.front"


def _write(root, **kw):
    return write_synthetic_dataset(
        root, layout="v2.1", num_episodes=2, episode_length=(6, 6), cameras=("front",),
        image_size=(16, 16), embodiments=(SPEC,), **kw,
    )  # fmt: skip


def test_embodiment_ids_set_the_column_and_the_values(tmp_path):
    (root,) = _write(tmp_path / "ds", embodiment_ids=(3,))
    table = pq.read_table(root / "data/chunk-000/episode_000001.parquet").to_pydict()
    assert table["embodiment_id"] == [3] * 6
    state = np.asarray(table["observation.state"], dtype=np.float32)
    np.testing.assert_array_equal(state, synthetic_state(1, np.arange(6), 4, 3))
    assert not np.array_equal(state, synthetic_state(1, np.arange(6), 4, 0))
    stats = json.loads((root / "meta/stats.json").read_text())
    assert stats["embodiment_id"]["min"] == stats["embodiment_id"]["max"] == [3]


def test_image_stats_stride_subsamples_frames_rows_and_columns(tmp_path):
    (root,) = _write(tmp_path / "strided", image_stats_stride=(2, 4, 4))
    (full,) = _write(tmp_path / "full")
    frames = np.concatenate([synthetic_frame(ep, np.arange(6), 0, 16, 16) for ep in range(2)])
    strided = json.loads((root / "meta/stats.json").read_text())[KEY]
    want = image_stats(frames[::2, ::4, ::4])
    for name in ("min", "max", "mean", "std", "q01", "q99"):
        np.testing.assert_allclose(np.asarray(strided[name]), want[name], rtol=0, atol=1e-12)
    assert strided["count"] == [6]
    every = json.loads((full / "meta/stats.json").read_text())[KEY]
    assert every["count"] == [12] and every["q01"] != strided["q01"]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"embodiment_ids": (0, 1)}, "embodiment_ids"),
        ({"embodiment_ids": (-1,)}, "embodiment_ids"),
        ({"image_stats_stride": (1, 0, 1)}, "image_stats_stride"),
    ],
)
def test_bad_options_name_the_argument(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _write(tmp_path / "bad", **kw)
