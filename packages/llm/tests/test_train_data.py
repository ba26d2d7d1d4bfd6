"""Training-data plumbing: step -> rows schedule, document attention mask, split and blend."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from longboat.core.data.batch_plan import BatchLayout
from longboat.llm.train.data import document_mask, row_plan, split_documents


class _Docs:
    def __init__(self, n: int, start: int = 0) -> None:
        self.docs = [np.arange(start + i, start + i + 3 + i % 4) for i in range(n)]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.docs[i]

    def lengths(self) -> np.ndarray:
        return np.asarray([len(d) for d in self.docs])


def test_schedule_is_a_pure_function_of_the_step_and_covers_each_epoch() -> None:
    s = row_plan(12, BatchLayout(global_batch=4, micro_batch=1, dp_size=2), seed=3)
    assert s.layout.accum == 2
    epoch = [
        r for step in range(3) for d in range(2) for mb in s.rank_micro_batches(step, d) for r in mb
    ]
    assert sorted(epoch) == list(range(12))  # one epoch = every row exactly once
    again = row_plan(12, BatchLayout(4, 1, 2), seed=3)
    assert again.rank_micro_batches(5, 1) == s.rank_micro_batches(5, 1)
    nxt = [
        r
        for step in range(3, 6)
        for d in range(2)
        for mb in s.rank_micro_batches(step, d)
        for r in mb
    ]
    assert sorted(nxt) == list(range(12)) and nxt != epoch  # a new permutation per epoch


def test_document_mask_blocks_attention_across_documents() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(pos)[0, 0]  # True = blocked
    doc = [0, 0, 0, 1, 1, 2]
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (doc[i] != doc[j]), (i, j)


def test_split_is_seeded_and_disjoint() -> None:
    docs = _Docs(40)
    train, held = split_documents(docs, 0.1, seed=7)
    assert len(held) == 4 and len(train) == 36
    assert set(train.index) | set(held.index) == set(range(40))
    assert not set(train.index) & set(held.index)
    assert list(split_documents(docs, 0.1, seed=7)[1].index) == list(held.index)


def test_blend_follows_the_weights() -> None:
    from longboat.llm.train.data import train_and_eval_documents

    data = SimpleNamespace(eval_fraction=0.1, seed=0, weights=[3.0, 1.0])
    train, held = train_and_eval_documents(data, [_Docs(50), _Docs(50, start=1000)])
    firsts = np.asarray([int(train[i][0]) for i in range(len(train))])
    share = float(np.mean(firsts >= 1000))
    assert abs(share - 0.25) < 0.02, share
    assert len(held) == 10
