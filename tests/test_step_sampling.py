"""Which rows of a step the compiled sampler takes and which the host sampler takes (fake
runner: its `sample` is the numpy twin of the compiled kernel)."""

from __future__ import annotations

import numpy as np

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.sampler import Sampler, log_softmax, make_generator
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import SchedulerConfig
from tallow.runtime.step_sampling import StepSampler

V = 101


def _forward(runner: FakeModelRunner, n: int) -> np.ndarray:
    for s in range(n):
        runner.add_sequence(s)
    return runner.forward([(s, [1 + s, 2 + s]) for s in range(n)])


def test_plain_rows_go_to_the_device_the_rest_to_the_host():
    runner = FakeModelRunner(vocab_size=V)
    logits = _forward(runner, 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.8, seed=5),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.7, frequency_penalty=1.0, seed=6),
    ]
    gens = [make_generator(p.seed) for p in params]
    sampling = StepSampler(runner)
    out = sampling.sample(logits, [0, 1, 2, 3], params, gens, [[1]] * 4, [[4, 4, 9]] * 4)
    assert (sampling.device_rows, sampling.host_rows) == (2, 2)
    assert runner.device_sampled_rows == 4  # the kernel runs over every row of the forward
    assert out.token_ids[0] == np.argmax(logits[0])
    assert out.token_ids[2] == np.argmax(logits[2])
    lp = log_softmax(logits[2:3])[0]
    assert abs(out.logprobs[2] - lp[out.token_ids[2]]) < 1e-6
    assert [t for t, _ in out.top_logprobs[2]] == [int(i) for i in np.argsort(-lp)[:2]]
    # the penalised row: exactly what the host sampler draws with the same generator state
    ref = Sampler().sample(logits[3:4], params[3:], [make_generator(6)], [[1]], [[4, 4, 9]])
    assert out.token_ids[3] == ref.token_ids[0]
    assert out.logprobs[:2] == [None, None]


def test_siblings_sharing_a_row_take_the_host_path():
    """n > 1 at the first token: several sequences draw from one logits row."""
    runner = FakeModelRunner(vocab_size=V)
    logits = _forward(runner, 1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    sampling = StepSampler(runner)
    sampling.sample(logits, [0, 0, 0], params, [make_generator(s) for s in range(3)], [], [])
    assert (sampling.device_rows, sampling.host_rows) == (1, 2)


def _engine(device: bool) -> Engine:
    runner = FakeModelRunner(page_size=4, num_pages=128, vocab_size=V, device_sampling=device)
    return Engine(runner, scheduler_config=SchedulerConfig(max_num_seqs=8))


def test_device_and_host_paths_draw_the_same_tokens():
    """One uniform per row per step from the row's own generator on either path."""
    prompts = [[(3 + 5 * i + j) % V for j in range(6 + i)] for i in range(5)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(max_tokens=20, temperature=1.2, top_k=7, seed=12),
        SamplingParams(max_tokens=20, temperature=0.6, min_p=0.1, seed=13),
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=1.0, seed=14),
    ]
    results = {}
    for device in (True, False):
        engine = _engine(device)
        outs = engine.generate(prompts, params)
        results[device] = [[t for o in r for d in o.outputs for t in d.token_ids] for r in outs]
        expected = (100, 0) if device else (0, 100)
        assert (engine.sampling.device_rows, engine.sampling.host_rows) == expected
    assert results[True] == results[False]


def test_a_runner_without_the_compiled_sampler_samples_on_the_host():
    engine = _engine(device=False)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert engine.sampling.device_rows == 0 and engine.runner.device_sampled_rows == 0


class _CountingTensor:
    """Stands in for a device tensor: counts copies to the host."""

    def __init__(self, host: np.ndarray) -> None:
        self.host, self.copies = host, 0

    def numpy(self) -> np.ndarray:
        self.copies += 1
        return self.host.copy()


def test_device_logits_reach_the_host_only_for_host_rows():
    """On a GPU the forward's logits stay on the device unless a host row reads them."""
    from tallow.runtime.model_runner import DeviceLogits

    runner = FakeModelRunner(vocab_size=V)
    host = _forward(runner, 3)
    plain = [SamplingParams(temperature=0.0)] * 3
    for params, copies in ((plain, 0), ([*plain[:2], SamplingParams(logprobs=True)], 1)):
        tensor = _CountingTensor(host)
        out = StepSampler(runner).sample(
            DeviceLogits(tensor, 3, V), [0, 1, 2], params, [make_generator(0)] * 3, [], []
        )
        assert tensor.copies == copies
        assert out.token_ids[:2].tolist() == np.argmax(host[:2], axis=1).tolist()
