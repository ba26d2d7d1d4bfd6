"""Write a small dataset with LeRobot's own LeRobotDataset.create / add_frame / save_episode."""

import shutil
import sys
from pathlib import Path

import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root = Path(sys.argv[1])
shutil.rmtree(root, ignore_errors=True)
H, W, FPS = 48, 64, 15
features = {
    "observation.state": {"dtype": "float32", "shape": (4,), "names": ["a", "b", "c", "d"]},
    "action": {"dtype": "float32", "shape": (3,), "names": ["x", "y", "z"]},
    "observation.images.cam": {
        "dtype": "video",
        "shape": (H, W, 3),
        "names": ["height", "width", "channels"],
    },
}
ds = LeRobotDataset.create(
    "local/test", fps=FPS, features=features, root=root, robot_type="toy", use_videos=True
)
lengths = [7, 11, 9]
tasks = ["pick", "place", "pick"]
for e, n in enumerate(lengths):
    for f in range(n):
        st = (np.arange(4) * 0.1 + e + f * 0.01).astype(np.float32)
        ac = (np.arange(3) * -0.2 + e * 10 + f).astype(np.float32)
        img = np.zeros((H, W, 3), np.uint8)
        img[..., 0] = 20 + 15 * f
        img[..., 1] = 40 + 60 * e
        img[..., 2] = np.linspace(0, 200, W, dtype=np.uint8)[None, :]
        ds.add_frame(
            {"observation.state": st, "action": ac, "observation.images.cam": img, "task": tasks[e]}
        )
    ds.save_episode()
ds.finalize()
print("written", root)
