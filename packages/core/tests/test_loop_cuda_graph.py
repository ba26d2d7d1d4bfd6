"""GraphedStep: warm-up, capture, replay with static inputs, input checks, eager fallback.

The capture logic is tested on CPU with a recording backend that stands in for torch.cuda
(it "captures" by remembering the function and "replays" by calling it on the static
inputs, which is what a CUDA graph does to the recorded kernels); the real CUDA graph is
tested where a GPU exists.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longboat.core.loop.cuda_graph import GraphCaptureError, GraphedStep, GraphInputError


class RecordingBackend:
    def __init__(self, fail: bool = False, state: list[torch.Tensor] = ()) -> None:
        self.side_runs = 0
        self.captures = 0
        self.fail = fail
        self.state = list(state)  # tensors fn mutates: a real capture does not run kernels
        self.syncs: list[str] = []  # what the sync finder reports on the last warm-up step

    def run_on_side_stream(self, fn):  # type: ignore[no-untyped-def]
        self.side_runs += 1
        return fn()

    def run_and_find_syncs(self, fn):  # type: ignore[no-untyped-def]
        return self.run_on_side_stream(fn), list(self.syncs)

    def capture(self, fn):  # type: ignore[no-untyped-def]
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        before = [t.clone() for t in self.state]
        out = fn()  # "records": the static outputs are the ones replays refresh
        for t, b in zip(self.state, before):
            t.copy_(b)  # ... without having run the step
        return (lambda: out.copy_(fn())), out


def _linear_step(w: torch.Tensor):  # type: ignore[no-untyped-def]
    """One SGD step on 0.5 * ||x w - y||^2 that reads only its static inputs."""

    def fn(inputs):  # type: ignore[no-untyped-def]
        x, y = inputs["x"], inputs["y"]
        grad = x.t() @ (x @ w - y) / x.shape[0]
        w.sub_(0.1 * grad)
        return ((x @ w - y) ** 2).mean().reshape(1)

    return fn


CPU = SimpleNamespace(device_type="cpu")


def test_every_call_is_one_real_step_and_matches_eager() -> None:
    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 3), "y": torch.randn(8, 1)} for _ in range(6)]
    w_eager, w_graph = torch.zeros(3, 1), torch.zeros(3, 1)
    eager = [float(_linear_step(w_eager)(b)) for b in batches]
    backend = RecordingBackend(state=[w_graph])
    step = GraphedStep(_linear_step(w_graph), accelerator=CPU, warmup=2, backend=backend)
    graphed = [float(step(b)) for b in batches]
    assert backend.side_runs == 2 and backend.captures == 1
    assert step.captured and step.replays == 4  # capture call + 3 replays
    # capture recorded step 3 and the replay ran it once: no step is doubled or lost
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w_graph, w_eager, rtol=1e-6, atol=1e-7)


def test_replay_reads_new_inputs_through_static_buffers() -> None:
    seen: list[torch.Tensor] = []

    def fn(inputs):  # type: ignore[no-untyped-def]
        seen.append(inputs["x"])
        return inputs["x"] * 2

    step = GraphedStep(fn, accelerator=CPU, warmup=1, backend=RecordingBackend())
    step({"x": torch.ones(2)})
    step({"x": torch.full((2,), 3.0)})  # capture
    out = step({"x": torch.full((2,), 5.0)})  # replay
    assert out.tolist() == [10.0, 10.0]
    # the captured call and every replay see the same static tensor, never the caller's
    assert seen[1] is seen[2]


def test_shape_change_after_capture_names_the_key() -> None:
    step = GraphedStep(
        lambda b: b["x"].sum().reshape(1), accelerator=CPU, warmup=1, backend=RecordingBackend()
    )
    step({"x": torch.ones(4, 2), "mask": torch.ones(4)})
    step({"x": torch.ones(4, 2), "mask": torch.ones(4)})
    with pytest.raises(GraphInputError, match=r"'x' is \[3, 2\].*recorded with \[4, 2\]"):
        step({"x": torch.ones(3, 2), "mask": torch.ones(4)})
    with pytest.raises(GraphInputError, match="'mask' is missing"):
        step({"x": torch.ones(4, 2)})


def test_a_host_sync_is_found_before_capture_and_named() -> None:
    backend = RecordingBackend()
    backend.syncs = ["model.py:12: called a synchronizing CUDA operation"]
    done = []
    step = GraphedStep(
        lambda b: done.append(1) or b["x"], accelerator=CPU, warmup=2, backend=backend
    )
    step({"x": torch.ones(1)})
    with pytest.raises(GraphCaptureError, match=r"model\.py:12"):
        step({"x": torch.ones(1)})
    assert len(done) == 2 and backend.captures == 0  # the step ran; nothing was captured


def test_a_host_sync_can_fall_back_to_eager_steps_with_a_warning() -> None:
    backend = RecordingBackend()
    backend.syncs = ["model.py:12: called a synchronizing CUDA operation"]
    outs = []
    step = GraphedStep(
        lambda b: b["x"] * 2, accelerator=CPU, warmup=2, backend=backend, eager_on_sync=True
    )
    outs.append(step({"x": torch.ones(1)}))
    with pytest.warns(UserWarning, match=r"eager steps from here on.*model\.py:12"):
        outs.append(step({"x": torch.full((1,), 2.0)}))  # the warm-up step's own output
    outs.append(step({"x": torch.full((1,), 3.0)}))
    assert [float(o) for o in outs] == [2.0, 4.0, 6.0]
    assert not step.active and backend.captures == 0 and "host sync" in step.reason


def test_failed_capture_stops_with_a_clear_error() -> None:
    step = GraphedStep(
        lambda b: b["x"] + 1, accelerator=CPU, warmup=1, backend=RecordingBackend(fail=True)
    )
    step({"x": torch.ones(1)})
    with pytest.raises(GraphCaptureError, match=r"host syncs.*graph turned off"):
        step({"x": torch.ones(1)})


def test_cpu_and_disabled_run_eagerly() -> None:
    calls = []
    step = GraphedStep(lambda b: calls.append(1) or b["x"], accelerator=CPU)
    for _ in range(5):
        step({"x": torch.ones(1)})
    assert len(calls) == 5 and not step.active and "cpu" in (step.reason or "")
    off = GraphedStep(lambda b: b["x"], accelerator=SimpleNamespace(device_type="cuda"),
                      enabled=False)  # fmt: skip
    assert not off.active and off.reason == "disabled by configuration"
    with pytest.raises(ValueError, match="warmup=0"):
        GraphedStep(lambda b: b, accelerator=CPU, warmup=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_training_step_matches_eager() -> None:
    """A real model + AdamW(capturable) step, graphed vs eager, same seeds and batches."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        ).cuda()
        opt = torch.optim.AdamW(
            model.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True
        )

        def fn(b):  # type: ignore[no-untyped-def]
            loss = torch.nn.functional.mse_loss(model(b["x"]), b["y"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        return model, fn

    gen = torch.Generator().manual_seed(1)
    batches = [
        {
            "x": torch.randn(64, 16, generator=gen).cuda(),
            "y": torch.randn(64, 1, generator=gen).cuda(),
        }
        for _ in range(8)
    ]
    results = []
    for graphed in (False, True):
        model, fn = build()
        from longboat.core.device.cuda import CUDAAccelerator

        step = GraphedStep(fn, accelerator=CUDAAccelerator(), warmup=2, enabled=graphed)
        losses = []
        for i, b in enumerate(batches):
            torch.manual_seed(100 + i)  # dropout draws: same seed per step in both runs
            losses.append(float(step(b)))
        assert step.captured == graphed and step.replays == (6 if graphed else 0)
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (le, pe), (lg, pg) = results
    torch.testing.assert_close(torch.tensor(lg), torch.tensor(le), rtol=1e-5, atol=1e-6)
    for a, b in zip(pg, pe):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_capture_check_watches_each_accelerators_rng_seeding() -> None:
    """core's capture_check flags torch's reseeding and every registered device's own
    (through ``Accelerator.rng_reseed_functions``), and restores the functions after."""
    from longboat.core.device.cuda import CUDAAccelerator
    from longboat.core.loop.capture_check import capture_hazards

    (owner, attr), *_ = CUDAAccelerator.rng_reseed_functions()
    original = getattr(owner, attr)
    with capture_hazards() as found:
        torch.manual_seed(0)  # seeds the device generators too: reported once
        getattr(owner, attr)(0)
    assert [h.op for h in found] == ["torch.manual_seed", f"{owner.__name__}.{attr}"]
    assert all("reseeds an RNG" in h.why for h in found)
    assert getattr(owner, attr) is original
