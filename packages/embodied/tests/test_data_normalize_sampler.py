"""Normalisation from stats (mean/std, min/max, q01/q99, modality groups) and sampler resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longboat.embodied.data import (
    EmbodimentSpec,
    EpisodeAwareSampler,
    LeRobotDataset,
    Normalizer,
    write_synthetic_dataset,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    (path,) = write_synthetic_dataset(
        tmp_path_factory.mktemp("norm"),
        layout="v3.0",
        num_episodes=4,
        episode_length=(15, 25),
        cameras=(),
        embodiments=(
            EmbodimentSpec(
                name="arm",
                state_dim=6,
                action_dim=5,
                action_groups={"arm": 3, "wrist": 1, "gripper": 1},
            ),
        ),
    )
    return path


def _all(ds, key):
    return torch.stack([ds[i][key] for i in range(len(ds))]).double()


def test_mean_std_gives_zero_mean_unit_std(root):
    ds = LeRobotDataset(root, normalization={"observation.state": "mean_std"})
    x = _all(ds, "observation.state")
    torch.testing.assert_close(x.mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        x.std(0, unbiased=False), torch.ones(6, dtype=torch.float64), atol=1e-5, rtol=0
    )


def test_min_max_and_quantiles_map_to_unit_interval(root):
    raw = LeRobotDataset(root)
    a = _all(raw, "action")
    mm = _all(LeRobotDataset(root, normalization={"action": "min_max"}), "action")
    assert mm.min(0).values.tolist() == pytest.approx([-1.0] * 5, abs=1e-6)
    assert mm.max(0).values.tolist() == pytest.approx([1.0] * 5, abs=1e-6)
    q = _all(LeRobotDataset(root, normalization={"action": "q01_q99"}), "action")
    # LeRobot's QUANTILES and GR00T's q99 name the same map.
    assert torch.equal(
        q, _all(LeRobotDataset(root, normalization={"action": "QUANTILES"}), "action")
    )
    assert torch.equal(q, _all(LeRobotDataset(root, normalization={"action": "q99"}), "action"))
    assert q.abs().max() <= 1.0  # clipped like GR00T
    q01, q99 = np.quantile(a.numpy(), 0.01, axis=0), np.quantile(a.numpy(), 0.99, axis=0)
    inside = (a.numpy() > q01) & (a.numpy() < q99)
    expected = 2 * (a.numpy() - q01) / (q99 - q01) - 1
    np.testing.assert_allclose(q.numpy()[inside], expected[inside], atol=1e-5)


def test_round_trip_and_modality_groups(root):
    ds = LeRobotDataset(root)
    norm = Normalizer(
        ds.meta.stats,
        {"action": "mean_std", "action.gripper": "identity", "action.wrist": "min_max"},
        modality=ds.meta.modality,
    )
    a = _all(ds, "action").float()
    y = norm.normalize("action", a)
    assert torch.equal(y[:, 4], a[:, 4])  # gripper group left as is
    assert y[:, 3].min().item() == pytest.approx(-1.0, abs=1e-6)  # wrist group min-max
    mean, std = ds.meta.stats["action"]["mean"], ds.meta.stats["action"]["std"]
    expected = (a[:, :3].double() - torch.tensor(mean[:3])) / torch.tensor(std[:3])
    torch.testing.assert_close(y[:, :3].double(), expected, atol=1e-5, rtol=0)
    back = norm.unnormalize("action", y)
    torch.testing.assert_close(back, a, atol=1e-5, rtol=0)
    # Chunks [T, D] and sample dicts go through the same map.
    sample = {"action": a[:4], "task": "x"}
    assert torch.equal(norm(sample)["action"], y[:4]) and norm(sample)["task"] == "x"
    torch.testing.assert_close(norm.inverse(norm(sample))["action"], a[:4], atol=1e-5, rtol=0)
    # Serialised parameters (shipped with an exported policy) give the same maps.
    import json

    again = Normalizer.from_dict(json.loads(json.dumps(norm.to_dict())))
    assert torch.equal(again.normalize("action", a), y)
    assert torch.equal(again.unnormalize("action", y), back)


def test_normalization_errors_name_the_key(root):
    stats = LeRobotDataset(root).meta.stats
    with pytest.raises(ValueError, match=r"normalization key 'action\.elbow'"):
        Normalizer(stats, {"action.elbow": "mean_std"})
    with pytest.raises(ValueError, match=r"normalization\['action'\]='zscore'"):
        Normalizer(stats, {"action": "zscore"})
    no_q = {"action": {k: v for k, v in stats["action"].items() if k not in ("q01", "q99")}}
    with pytest.raises(ValueError, match=r"needs stats\['action'\]\['q01'\]"):
        Normalizer(no_q, {"action": "q01_q99"})


RANGES = [(0, 7), (7, 20), (20, 23), (23, 40)]


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_sampler_resume_is_exact_across_epochs():
    ref = EpisodeAwareSampler(RANGES, seed=5)
    uninterrupted = list(ref) + list(ref)  # two epochs
    assert sorted(uninterrupted[:40]) == list(range(40))
    assert uninterrupted[:40] != uninterrupted[40:]  # epochs are reshuffled
    for cut in (0, 13, 39, 40, 57):
        a = EpisodeAwareSampler(RANGES, seed=5)
        it = iter(a)
        got = _take(it, min(cut, 40))
        if cut >= 40:
            assert next(it, None) is None  # finishes epoch 0
            it = iter(a)
            got += _take(it, cut - 40)
        state = a.state_dict()
        b = EpisodeAwareSampler(RANGES, seed=5)
        b.load_state_dict(state)
        rest = list(b)
        if cut < 40:
            rest += list(b)
        assert got + rest == uninterrupted, cut


def test_sampler_consumed_override_and_guard():
    a = EpisodeAwareSampler(RANGES, seed=1)
    it = iter(a)
    prefetched = _take(it, 10)  # a DataLoader ran ahead of the training step
    state = a.state_dict(consumed=6)
    b = EpisodeAwareSampler(RANGES, seed=1)
    b.load_state_dict(state)
    assert next(iter(b)) == prefetched[6]
    with pytest.raises(ValueError, match="world_size=1 but this sampler has world_size=2"):
        EpisodeAwareSampler(RANGES, seed=1, rank=0, world_size=2).load_state_dict(state)


def test_sampler_shards_and_episode_trimming():
    shards = [list(EpisodeAwareSampler(RANGES, seed=2, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shards] == [14, 14, 14]  # 40 padded to 42
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(40)) and len(flat) - len(set(flat)) == 2
    dropped = [
        list(EpisodeAwareSampler(RANGES, seed=2, rank=r, world_size=3, drop_last=True))
        for r in range(3)
    ]
    assert len({i for s in dropped for i in s}) == 39
    trimmed = set(
        EpisodeAwareSampler(RANGES, shuffle=False, drop_n_first_frames=1, drop_n_last_frames=2)
    )
    assert trimmed == {i for s, e in RANGES for i in range(s + 1, e - 2)}
    with pytest.raises(ValueError, match="rank=3"):
        EpisodeAwareSampler(RANGES, rank=3, world_size=3)


def test_sampler_drives_a_dataloader(root):
    ds = LeRobotDataset(root, delta_timestamps={"action": [0.0, 0.1, 0.2]})
    sampler = EpisodeAwareSampler(ds.episode_ranges, seed=0, drop_n_last_frames=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)
    batch = next(iter(loader))
    assert batch["action"].shape == (4, 3, 5) and not batch["action_is_pad"].any()
    assert len(batch["task"]) == 4


def test_mixed_embodiments_pad_collate(tmp_path):
    from longboat.embodied.data import MultiLeRobotDataset, pad_collate

    roots = write_synthetic_dataset(
        tmp_path,
        num_episodes=2,
        episode_length=(6, 6),
        cameras=(),
        embodiments=(
            EmbodimentSpec(name="a", state_dim=6, action_dim=5),
            EmbodimentSpec(name="b", state_dim=3, action_dim=2),
        ),
    )
    assert [r.name for r in roots] == ["a", "b"]
    ds = MultiLeRobotDataset(roots, embodiment_ids=[2, 3], delta_timestamps={"action": [0.0, 0.1]})
    assert len(ds) == 24 and ds.episode_ranges[2] == (12, 18)
    batch = pad_collate([ds[0], ds[13]], max_state_dim=8, max_action_dim=8)
    assert batch["embodiment_id"].tolist() == [2, 3]
    assert batch["observation.state"].shape == (2, 8) and batch["action"].shape == (2, 2, 8)
    assert batch["state_dim_mask"].sum(1).tolist() == [6, 3]
    assert batch["action_dim_mask"].sum(1).tolist() == [5, 2]
    assert torch.equal(batch["action"][1, :, 2:], torch.zeros(2, 6))
    assert torch.equal(batch["action"][1, :, :2], ds[13]["action"])
    assert batch["action_is_pad"].shape == (2, 2) and len(batch["task"]) == 2
    with pytest.raises(ValueError, match="raise max_state_dim"):
        pad_collate([ds[0]], max_state_dim=4, max_action_dim=8)


def test_sharded_sampler_resume_per_rank():
    for rank in range(2):
        ref = EpisodeAwareSampler(RANGES, seed=9, rank=rank, world_size=2, drop_n_last_frames=1)
        full = list(ref) + list(ref)
        a = EpisodeAwareSampler(RANGES, seed=9, rank=rank, world_size=2, drop_n_last_frames=1)
        it = iter(a)
        head = _take(it, 11)
        b = EpisodeAwareSampler(RANGES, seed=9, rank=rank, world_size=2, drop_n_last_frames=1)
        b.load_state_dict(a.state_dict())
        assert head + list(b) + list(b) == full


def test_make_synthetic_cli(tmp_path, capsys):
    """``longboat-embodied data make-synthetic``: camera names and full keys give the same key
    (``--cameras observation.images.top`` once wrote ``observation.images.observation.images.top``)."""
    from longboat.embodied.cli import main

    argv = ["data", "make-synthetic", str(tmp_path), "--layout", "v2.1", "--episodes", "2"]
    argv += ["--length", "4", "6", "--cameras", "top", "--embodiment", "a:3:2"]
    assert main([*argv, "--embodiment", "b:4:4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "LeRobot v2.1, 2 episodes" in out[0]
    ds = LeRobotDataset(tmp_path / "b", image_dtype="uint8")
    assert ds[0]["observation.state"].shape == (4,) and ds.camera_keys == ["observation.images.top"]
    keyed = tmp_path / "keyed"
    argv = ["data", "make-synthetic", str(keyed), "--episodes", "1", "--length", "4", "4"]
    assert main([*argv, "--cameras", "observation.images.top", "wrist"]) == 0
    assert LeRobotDataset(keyed).camera_keys == [
        "observation.images.top",
        "observation.images.wrist",
    ]
    capsys.readouterr()
    for bad, says in (
        (["--embodiment", "bad"], "expected NAME:STATE_DIM:ACTION_DIM"),
        (["--cameras", "top", "observation.images.top"], "names a camera twice"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["data", "make-synthetic", str(tmp_path / "bad"), *bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
