"""Paths from a LeRobot dataset's info.json must stay under the dataset root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longboat.embodied.data import EmbodimentSpec, write_synthetic_dataset
from longboat.embodied.data.layout import INFO_PATH, LeRobotFormatError
from longboat.embodied.data.metadata import LeRobotMetadata


@pytest.mark.parametrize("layout", ["v2.1", "v3.0"])
@pytest.mark.parametrize(
    ("key", "template"),
    [
        ("data_path", "../../../../etc/passwd"),
        ("data_path", "/etc/passwd"),
        ("video_path", "videos/../../elsewhere/{video_key}.mp4"),
    ],
)
def test_a_path_outside_the_dataset_root_is_refused(
    tmp_path: Path, layout: str, key: str, template: str
) -> None:
    (root,) = write_synthetic_dataset(
        tmp_path / "ds",
        layout=layout,
        num_episodes=1,
        episode_length=(4, 4),
        cameras=("cam",),
        image_size=(8, 8),
        embodiments=(EmbodimentSpec(name="toy", state_dim=2, action_dim=2),),
    )
    LeRobotMetadata.load(root)  # as written: opens
    info_path = Path(root) / INFO_PATH
    info = json.loads(info_path.read_text())
    info[key] = template
    info_path.write_text(json.dumps(info))
    with pytest.raises(LeRobotFormatError) as err:
        LeRobotMetadata.load(root)
    text = str(err.value)
    assert text.startswith(f"{info_path}: {key} template {template!r} gives ")
    assert f"outside the dataset root {Path(root).resolve()}" in text
    assert err.value.exit_code == 2
