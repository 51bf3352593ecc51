"""Plans: a repeated call with the same signatures skips the full path and gives the same results.

CPU tests cover the plan key (what it includes, what falls back); GPU tests run each planned
function twice with fresh inputs, check the second call really took the plan (the full path is
made to fail), compare with the float64 reference, and check the fallbacks (misaligned views,
another stream) and that torch outputs come from torch's allocator.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import _arrays, _calls, reference
from conftest import BF16, check_decode, error_budget, prefix_sums, randn


class FakeTorch:
    """What the plan key reads of a torch tensor, without torch or a GPU."""

    __module__ = "torch"

    def __init__(self, shape, strides, dtype="bf16", device="cuda:0"):
        self.shape, self._strides, self.dtype, self.device = shape, strides, dtype, device

    def stride(self):
        return self._strides


def test_key_holds_every_signature_and_option():
    q = FakeTorch((1, 8, 4, 64), (2048, 256, 64, 1))
    k = FakeTorch((1, 9, 2, 64), (1152, 128, 64, 1))
    base = _calls.key("attention", (q, k, k, None), (True, None, 0, 0, 0.0, False))
    assert base is not None
    # the same call again (new arrays of the same signatures) has an equal key that finds base's plan
    again = _calls.key("attention", (FakeTorch(q.shape, q.stride()), FakeTorch(k.shape, k.stride()),
                                     FakeTorch(k.shape, k.stride()), None), (True, None, 0, 0, 0.0, False))
    assert again == base and hash(again) == hash(base)
    assert {base: "plan"}.get(again) == "plan"
    transposed = FakeTorch((1, 8, 4, 64), (2048, 64, 512, 1))
    assert _calls.key("attention", (transposed, k, k, None), (True, None, 0, 0, 0.0, False)) != base
    assert _calls.key("attention", (q, k, k, None), (False, None, 0, 0, 0.0, False)) != base
    other_device = FakeTorch((1, 9, 2, 64), (1152, 128, 64, 1), device="cuda:1")
    assert _calls.key("attention", (q, other_device, k, None), (True, None, 0, 0, 0.0, False)) != base


def test_arrays_without_a_fast_reader_and_unhashable_options_take_the_full_path():
    x = np.zeros((1, 8, 4, 64), np.float16)
    assert _calls.key("attention", (x, x, x, None), ()) is None
    q = FakeTorch((1, 8, 4, 64), (2048, 256, 64, 1))
    assert _calls.key("attention", (q, q, q, None), ([1, 2],)) is None


def test_plan_table_is_bounded(monkeypatch):
    monkeypatch.setattr(_calls, "_plans", {})
    for i in range(_calls.MAX_PLANS + 3):
        _calls.remember(("k", i), object())
    assert len(_calls._plans) <= _calls.MAX_PLANS
    _calls.remember(None, object())
    _calls.remember(("k", "none"), None)
    assert ("k", "none") not in _calls._plans


class _RecordingLaunch:
    """What a Plan needs of a _jit.Launch: named pointer slots, and the pointers of each run."""

    device_id = 0

    def __init__(self, fields):
        self.fields = fields
        self.runs = []

    def slot(self, field):
        return self.fields.index(field)

    def run(self, stream, pointers=()):
        self.runs.append((stream, dict(pointers)))


class _FakeArray:
    def __init__(self, address, shape=(), float32=False):
        self.address, self.shape, self.float32 = address, shape, float32


class _FakeReader:
    """A framework whose arrays are _FakeArrays; new ones are allocated at increasing addresses."""

    def __init__(self):
        self.next = 0x10000

    def device_ok(self, x, device_id):
        return True

    def address(self, x):
        return x.address

    def stream(self, x):
        return 7

    def empty(self, shape, like, float32=False):
        self.next += 0x1000
        return _FakeArray(self.next, shape, float32)

    zeros = empty


def test_plan_roles_resolve_inputs_outputs_regions_of_outputs_and_nulls():
    launch = _RecordingLaunch(["a", "b", "out", "lse", "tmp", "tmp2", "missing"])
    plan = _calls.Plan(inputs=("a", "b"), outputs={"out": ((2, 3), False), "scratch": ((64,), True)},
                       bound=[_calls.Bound(launch, {"a": "a", "b": "b", "out": "out", "lse": "lse",
                                                    "tmp": "scratch+0", "tmp2": "scratch+96", "missing": "nothing"})],
                       finish=lambda results, arrays: results, aligned=("a",))
    reader = _FakeReader()
    results = plan.run([_FakeArray(0x100), _FakeArray(0x200)], [reader, reader])
    assert set(results) == {"out", "scratch"} and results["scratch"].float32 and results["out"].shape == (2, 3)
    stream, pointers = launch.runs[0]
    scratch = results["scratch"].address
    assert stream == 7
    assert pointers == {0: 0x100, 1: 0x200, 2: results["out"].address, 3: 0, 4: scratch, 5: scratch + 96, 6: 0}
    # an input misaligned for a vector load sends the call down the full path
    assert plan.run([_FakeArray(0x108), _FakeArray(0x200)], [reader, reader]) is None


def test_a_plan_whose_first_input_is_an_output_is_refused():
    """The first input fixes the call's framework and device, so it cannot be an array the plan allocates."""
    launch = _RecordingLaunch(["out", "a"])
    with pytest.raises(ValueError, match=r"^a plan's first input is the array whose framework and device the call "
                                         r"follows$"):
        _calls.Plan(inputs=("out", "a"), outputs={"out": ((2, 3), False)},
                    bound=[_calls.Bound(launch, {"out": "out", "a": "a"})],
                    finish=lambda results, arrays: results, aligned=())


def test_plan_step_roles_write_the_step_between_evenly_spaced_inputs():
    """A ``step:ITEMSIZE:...`` role writes the constant step between its inputs' addresses in
    elements (an int64 word, two's complement below the first input, 0 for one input); inputs
    not evenly spaced in whole elements send the call to the full path."""
    launch = _RecordingLaunch(["a", "step", "one"])
    plan = _calls.Plan(inputs=("a", "b", "c"), outputs={},
                       bound=[_calls.Bound(launch, {"a": "a", "step": "step:2:a,b,c", "one": "step:4:b"})],
                       finish=lambda results, arrays: "ran", aligned=())
    reader = _FakeReader()

    def run(*addresses):
        return plan.run([_FakeArray(x) for x in addresses], [reader] * 3)

    assert run(0x1000, 0x1100, 0x1200) == "ran"
    assert launch.runs[-1][1] == {0: 0x1000, 1: 0x80, 2: 0}
    assert run(0x3000, 0x2000, 0x1000) == "ran"
    assert launch.runs[-1][1][1] == (-0x800) & ((1 << 64) - 1)
    runs = len(launch.runs)
    assert run(0x1000, 0x1100, 0x1300) is None  # not evenly spaced
    assert run(0x1000, 0x1001, 0x1002) is None  # not whole elements
    assert len(launch.runs) == runs


def test_plan_step_writes_pointers_once_and_owns_its_outputs():
    """Plan.step binds every pointer (Launch.bind) and returns a StepPlan whose run() launches
    with no pointers of its own; a plan that uses the per-stream workspace has no step."""
    bound = {}

    class BindingLaunch(_RecordingLaunch):
        def bind(self, pointers):
            bound.update(dict(pointers))

    launch = BindingLaunch(["a", "out", "tmp"])
    plan = _calls.Plan(inputs=("a",), outputs={"out": ((4,), False), "scratch": ((8,), True)},
                       bound=[_calls.Bound(launch, {"a": "a", "out": "out", "tmp": "scratch+32"})],
                       finish=lambda results, arrays: results["out"], aligned=())
    reader = _FakeReader()
    step = plan.step([_FakeArray(0x100)], [reader])
    assert bound == {0: 0x100, 1: step.out.address, 2: step._buffers[1].address + 32}
    assert step.lse is None and len(step._buffers) == 2 and not launch.runs
    with_workspace = _calls.Plan(inputs=("a",), outputs={"out": ((4,), False)},
                                 bound=[_calls.Bound(launch, {"a": "a", "tmp": "workspace+0"})],
                                 finish=lambda results, arrays: results["out"], aligned=(), workspace=64,
                                 workspace_of=lambda nbytes, stream, device: 0)
    with pytest.raises(ValueError, match="a plan with a per-stream workspace has no step of its own"):
        with_workspace.step([_FakeArray(0x100)], [reader])


# ---------------------------------------------------------------------------------------------
# GPU


def _full_path_must_not_run(monkeypatch):
    def refuse(**named):
        raise AssertionError("a planned call took the full path")

    monkeypatch.setattr(_arrays, "array_context", refuse)


def _as(framework, x):
    import cupy

    device = cupy.asarray(x)
    if framework == "torch":
        import torch

        return torch.from_dlpack(device)
    return device


def _host(x):
    return _arrays.to_numpy(x).astype(np.float64)


def _check_forward(rng, q, k, v, got, dtype, **options):
    ref = reference.attention(q, k, v, **options)
    naive = reference.naive_attention_lowp(q, k, v, dtype=dtype, **options)
    budget = error_budget(np.abs(naive - ref).max(), dtype, 2.0, np.abs(ref).max())
    err = np.abs(_host(got) - ref).max()
    assert err <= budget, f"error {err:.3g} > {budget:.3g} (seed {rng.seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_attention_second_call_takes_the_plan(rng, framework, monkeypatch):
    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    shapes = ((2, 113, 4, 64), (2, 203, 2, 64))
    options = dict(causal=True, window=(64, 0), softcap=20.0)
    for step in range(2):
        if step == 1:
            assert len(_calls._plans) == 1
            _full_path_must_not_run(monkeypatch)
        q, k, v = (randn(rng, s, BF16) for s in (shapes[0], shapes[1], shapes[1]))
        out, lse = cuattn.attention(*(_as(framework, x) for x in (q, k, v)), return_lse=True, **options)
        assert type(out).__module__.split(".")[0] == framework
        _check_forward(rng, q, k, v, out, BF16, **options)
        ref_lse = reference.attention(q, k, v, return_lse=True, **options)[1]
        np.testing.assert_allclose(_host(lse), ref_lse, rtol=1e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_a_plan_runs_on_a_thread_without_a_cuda_context(rng, framework, monkeypatch):
    """A plan recorded on this thread, run on a new one that has made no CUDA call (as torch's
    autograd worker runs a backward): the driver launch needs the device's context made current
    there first."""
    import threading

    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    shape = (1, 77, 4, 64)
    q, k, v = (randn(rng, shape, BF16) for _ in range(3))
    arrays = [_as(framework, x) for x in (q, k, v)]
    cuattn.attention(*arrays, causal=True)
    assert len(_calls._plans) == 1
    _full_path_must_not_run(monkeypatch)
    results, errors = [], []

    def call():
        try:
            results.append(cuattn.attention(*arrays, causal=True))
        except Exception as error:  # reported below, on the test's thread
            errors.append(error)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert not errors, errors
    _check_forward(rng, q, k, v, results[0], BF16, causal=True)


# (D, Dv, options, deterministic): the wgmma kernel with atomic and ordered dQ (sm_90a), with the
# deterministic dQ kernel (D = 64, ALiBi's fallback), the mma.sync kernels (D = 96, and D = 80
# with v's own head dim in the 96 tile)
BACKWARD_PLAN_CASES = [(128, 128, dict(causal=True), False), (128, 128, dict(causal=True), True),
                       (64, 64, dict(window=(40, 8)), True), (128, 128, dict(causal=True, alibi=True), True),
                       (96, 96, dict(softcap=20.0), False), (80, 48, dict(causal=True), True)]


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("d, dv, options, deterministic", BACKWARD_PLAN_CASES,
                         ids=["d128-atomic", "d128-ordered", "d64-det-window", "d128-alibi-det", "d96-softcap",
                              "d80-dv48-det"])
def test_backward_second_call_takes_the_plan(rng, framework, monkeypatch, d, dv, options, deterministic):
    """The planned call allocates fresh gradients and zeroed workspace: over new inputs it matches
    the reference, and (deterministic) its gradients equal the full path's bit for bit."""
    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = _as(framework, np.linspace(0.05, 0.5, 4).astype(np.float32))
    shapes = ((2, 113, 4, d), (2, 203, 2, d), (2, 203, 2, dv), (2, 113, 4, dv))
    host = [randn(rng, s, BF16) for s in shapes]
    for step in range(3):
        if step == 1:
            assert [key[0] for key in _calls._plans] == ["attention", "attention_backward"]
            _full_path_must_not_run(monkeypatch)
        if step == 2:  # new values in the same shapes: the plan's workspace starts from zero again
            host = [randn(rng, s, BF16) for s in shapes]
        q, k, v, dout = (_as(framework, x) for x in host)
        out, lse = cuattn.attention(q, k, v, return_lse=True, **options)
        got = cuattn.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
        if step == 0:
            full = got  # the full path's gradients
        assert all(type(g).__module__.split(".")[0] == framework for g in got)
        if step == 1 and deterministic:
            for name, a, b in zip(("dq", "dk", "dv"), full, got):
                assert np.array_equal(_arrays.to_numpy(a).view(np.uint16), _arrays.to_numpy(b).view(np.uint16)), name
        ref_options = {**options, "alibi_slopes": None if "alibi_slopes" not in options else _host(options["alibi_slopes"])}
        qh, kh, vh, doh = host
        ref_out, ref_lse = reference.attention(qh, kh, vh, return_lse=True, **ref_options)
        refs = reference.attention_backward(doh, qh, kh, vh, ref_out, ref_lse, **ref_options)
        naive = reference.naive_attention_backward_lowp(doh, qh, kh, vh, dtype=BF16, **ref_options)
        for name, g, ref, low in zip(("dq", "dk", "dv"), got, refs, naive):
            budget = error_budget(np.abs(low - ref).max(), BF16, 3.0, np.abs(ref).max())
            err = np.abs(_host(g) - ref).max()
            assert err <= budget, f"step {step} {name}: error {err:.3g} > {budget:.3g} (seed {rng.seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("d, deterministic", [(128, False), (128, True), (96, True)],
                         ids=["d128-atomic", "d128-ordered", "d96-det"])
def test_varlen_backward_second_call_takes_the_plan(rng, framework, monkeypatch, d, deterministic):
    """Ragged sequences (one without queries, one without keys): the plan's zeroed gradients leave
    the rows and keys of no sequence at 0, as the full path does."""
    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    lens_q, lens_k = [1, 17, 113, 0, 7], [5, 17, 203, 9, 0]
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    shapes = ((int(cu_q[-1]), 4, d), (int(cu_k[-1]), 2, d), (int(cu_k[-1]), 2, d), (int(cu_q[-1]), 4, d))
    args = (_as(framework, cu_q), _as(framework, cu_k), max(lens_q), max(lens_k))
    host = [randn(rng, s, BF16) for s in shapes]
    for step in range(3):
        if step == 1:
            assert sorted(key[0] for key in _calls._plans) == ["attention_varlen", "attention_varlen_backward"]
            _full_path_must_not_run(monkeypatch)
        if step == 2:
            host = [randn(rng, s, BF16) for s in shapes]
        q, k, v, dout = (_as(framework, x) for x in host)
        out, lse = cuattn.attention_varlen(q, k, v, *args, causal=True, return_lse=True)
        got = cuattn.attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=True,
                                               deterministic=deterministic)
        if step == 0:
            full = got  # the full path's gradients
        if step == 1 and deterministic:
            for name, a, b in zip(("dq", "dk", "dv"), full, got):
                assert np.array_equal(_arrays.to_numpy(a).view(np.uint16), _arrays.to_numpy(b).view(np.uint16)), name
        qh, kh, vh, doh = host
        ref_out, ref_lse = reference.attention_varlen(qh, kh, vh, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                      return_lse=True)
        refs = reference.attention_varlen_backward(doh, qh, kh, vh, ref_out, ref_lse, cu_q, cu_k, max(lens_q),
                                                   max(lens_k), causal=True)
        naive = [np.zeros_like(r) for r in refs]
        for b in range(len(lens_q)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if lens_q[b] and lens_k[b]:
                low = reference.naive_attention_backward_lowp(doh[None, rows], qh[None, rows], kh[None, keys],
                                                              vh[None, keys], causal=True, dtype=BF16)
                for total, part, at in zip(naive, low, (rows, keys, keys)):
                    total[at] = part[0]
        for name, g, ref, low in zip(("dq", "dk", "dv"), got, refs, naive):
            g = _host(g)
            budget = error_budget(np.abs(low - ref).max(), BF16, 3.0, np.abs(ref).max())
            err = np.abs(g - ref).max()
            assert err <= budget, f"step {step} {name}: error {err:.3g} > {budget:.3g} (seed {rng.seed})"
            empty = np.concatenate([np.arange(cu_k[b], cu_k[b + 1]) for b in range(len(lens_k)) if lens_q[b] == 0])
            if name != "dq":
                assert not g[empty].any(), f"step {step} {name}: keys no query sees must get 0"


@pytest.mark.gpu
def test_backward_with_sinks_or_a_strided_lse_takes_no_plan(rng):
    import cupy

    _calls.clear()
    q, k, v, dout = (cupy.asarray(randn(rng, (1, 33, 2, 64), BF16)) for _ in range(4))
    sinks = cupy.asarray(np.array([0.5, -1.0], np.float32))
    out, lse = cuattn.attention(q, k, v, return_lse=True, sinks=sinks)
    cuattn.attention_backward(dout, q, k, v, out, lse, sinks=sinks)
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    strided = cupy.empty((1, 2, 66), cupy.float32)[..., ::2]
    strided[...] = lse
    cuattn.attention_backward(dout, q, k, v, out, strided)
    assert [key[0] for key in _calls._plans].count("attention_backward") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_varlen_second_call_takes_the_plan(rng, framework, monkeypatch):
    """New q, k, v and cu_seqlens arrays each step (new addresses, new tensor maps on Hopper)."""
    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    lens_q, lens_k = [37, 0, 130], [50, 9, 130]
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    for step in range(2):
        if step == 1:
            assert [key[0] for key in _calls._plans] == ["attention_varlen"]
            _full_path_must_not_run(monkeypatch)
        q = randn(rng, (cu_q[-1], 4, 64), BF16)
        k, v = (randn(rng, (cu_k[-1], 2, 64), BF16) for _ in range(2))
        out, lse = cuattn.attention_varlen(*(_as(framework, x) for x in (q, k, v, cu_q, cu_k)), max(lens_q),
                                           max(lens_k), causal=True, return_lse=True)
        assert type(out).__module__.split(".")[0] == framework
        ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                  return_lse=True)
        for i in range(len(lens_q)):
            rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            naive = reference.naive_attention_lowp(q[None, rows], k[None, keys], v[None, keys], causal=True,
                                                   dtype=BF16)[0]
            budget = error_budget(np.abs(naive - ref[rows]).max(initial=0), BF16, 2.0,
                                  np.abs(ref[rows]).max(initial=0))
            assert np.abs(_host(out)[rows] - ref[rows]).max(initial=0) <= budget, f"sequence {i} (seed {rng.seed})"
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(_host(lse)[finite], ref_lse[finite], rtol=1e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_decode_and_paged_second_call_takes_the_plan(rng, framework, monkeypatch):
    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    b, hq, hk, d, s_max, block = 3, 8, 2, 128, 4096, 16
    lens = np.array([4096, 1, 2900], np.int32)
    for step in range(2):
        if step == 1:
            _full_path_must_not_run(monkeypatch)
        q = randn(rng, (b, 1, hq, d), BF16)
        k, v = (randn(rng, (b, s_max, hk, d), BF16) for _ in range(2))
        out = cuattn.decode(*(_as(framework, x) for x in (q, k, v, lens)))
        check_decode(rng, BF16, q, k, v, lens, _host(out), None)
        # the same cache as pages in shuffled blocks, through a device table, unchecked
        pages = rng.permutation(b * s_max // block).astype(np.int32)
        table = pages.reshape(b, -1)
        k_pages, v_pages = (np.zeros((b * s_max // block, block, hk, d), BF16) for _ in range(2))
        k_pages[pages] = k.reshape(-1, block, hk, d)
        v_pages[pages] = v.reshape(-1, block, hk, d)
        paged = cuattn.paged_attention(_as(framework, q), (_as(framework, k_pages), _as(framework, v_pages)),
                                       _as(framework, table), _as(framework, lens), check=False)
        check_decode(rng, BF16, q, k, v, lens, _host(paged), None)  # the same rows as pages
    assert len(_calls._plans) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("parts", [2, 3])
def test_merge_states_second_call_takes_the_plan(rng, framework, parts, monkeypatch):
    """merge_states over fresh parts each call, each set slices of one device array: the first call
    reads them in place through the full path and records a plan; later calls with the same
    signatures take the plan at other spacings (every other slice, then every third in reverse
    order: a step that is not the first call's, and one below zero, written per call) and match the
    float64 merge; parts not evenly spaced go back to the full path."""
    if framework == "torch":
        pytest.importorskip("torch")
    _calls.clear()
    b, s, h, d = 2, 37, 4, 64

    def states(spread, reverse=False):
        # the parts are slices `spread` apart of one device array: evenly spaced whatever the allocator does
        outs = randn(rng, (parts * spread, b, s, h, d), BF16)
        lses = rng.standard_normal((parts * spread, b, h, s)).astype(np.float32)
        dev_outs, dev_lses = _as(framework, outs), _as(framework, lses)
        order = list(range(0, parts * spread, spread))[::-1 if reverse else 1]
        return [(outs[i], lses[i]) for i in order], [(dev_outs[i], dev_lses[i]) for i in order]

    def merge_and_check(host, dev, what):
        merged, merged_lse = cuattn.merge_states(dev)
        ref, ref_lse = reference.merge_states(host)
        assert np.abs(_host(merged) - ref).max() < 2e-2, f"{what} (seed {rng.seed})"
        assert np.abs(_host(merged_lse) - ref_lse).max() < 1e-4, f"{what} (seed {rng.seed})"
        assert type(merged) is type(dev[0][0])

    merge_and_check(*states(1), "the full path")
    assert len(_calls._plans) == 1
    _full_path_must_not_run(monkeypatch)
    merge_and_check(*states(2), "the plan, every other slice")
    merge_and_check(*states(3, reverse=True), "the plan, every third slice in reverse")
    monkeypatch.undo()
    if parts == 3:
        # the first two parts adjacent, the third a copy elsewhere: the plan refuses, the full path copies
        full_path = _arrays.array_context
        entered = []
        monkeypatch.setattr(_arrays, "array_context", lambda **named: entered.append(1) or full_path(**named))
        host, dev = states(1)
        third = (_as(framework, host[2][0].copy()), _as(framework, host[2][1].copy()))
        merge_and_check(host, dev[:2] + [third], "parts not evenly spaced")
        assert entered, "parts not evenly spaced took the plan"


@pytest.mark.gpu
def test_a_misaligned_view_falls_back_to_the_full_path_and_its_error():
    import cupy

    _calls.clear()
    base = cupy.zeros((1, 8, 2, 64 + 8), cupy.float16)
    aligned = base[..., :64]
    cuattn.attention(aligned, aligned, aligned)
    flat = cupy.zeros(base.size + 1, cupy.float16)
    shifted = flat[1:].reshape(base.shape)[..., :64]  # same shape and strides, 2 bytes off
    assert shifted.strides == aligned.strides and shifted.data.ptr % 16
    with pytest.raises(ValueError, match=r"q must start on a 16-byte boundary"):
        cuattn.attention(shifted, aligned, aligned)


@pytest.mark.gpu
def test_torch_outputs_come_from_torchs_allocator_on_its_current_stream(rng):
    torch = pytest.importorskip("torch")
    _calls.clear()
    q = torch.randn(1, 256, 8, 64, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    kept = []  # every output stays alive, so each call's allocation shows
    for _ in range(2):  # the full path, then the plan
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.cuda.stream(side):
            out = cuattn.attention(q, q, q, causal=True)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True).transpose(1, 2)
        kept.append(out)
        assert torch.cuda.memory_allocated() - before >= out.numel() * out.element_size()
        side.synchronize()
        assert (out.float() - expected.float()).abs().max().item() < 2e-2


# ---------------------------------------------------------------------------------------------
# Step plans (plan once, run many)


def test_step_plans_refuse_numpy_arrays():
    q = np.zeros((1, 1, 4, 64), np.float32)
    k = np.zeros((1, 16, 2, 64), np.float32)
    with pytest.raises(TypeError, match=r"plan_decode plans GPU launches and got NumPy arrays; call cuattn.decode"):
        cuattn.plan_decode(q, k, k, np.array([16], np.int32))
    cache = cuattn.PagedKVCache(4, 4, 2, 64, np.float32, device="cpu")
    with pytest.raises(TypeError, match=r"plan_paged_attention plans GPU launches and got NumPy arrays"):
        cuattn.plan_paged_attention(q, cache, np.array([[0, 1]], np.int32), np.array([8], np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_decode_plan_runs_steps_over_arrays_updated_in_place(rng, framework):
    if framework == "torch":
        pytest.importorskip("torch")
    b, s_max, hq, hk, d = 2, 4096, 16, 4, 128
    q = _as(framework, randn(rng, (b, 1, hq, d), BF16))
    k, v = (_as(framework, randn(rng, (b, s_max, hk, d), BF16)) for _ in range(2))
    lens = _as(framework, np.array([4000, 1500], np.int32))
    plan = cuattn.plan_decode(q, k, v, lens, return_lse=True)
    for step in range(3):
        q[...] = _as(framework, randn(rng, tuple(q.shape), BF16))
        lens[...] = _as(framework, np.array([4000 - step, 1 + 700 * step], np.int32))
        out, lse = plan.run()
        assert out is plan.out and lse is plan.lse
        expected, expected_lse = cuattn.decode(q, k, v, lens, return_lse=True)
        # the same kernels with the same split count: the same bits
        np.testing.assert_array_equal(_arrays.to_numpy(out), _arrays.to_numpy(expected))
        np.testing.assert_array_equal(_arrays.to_numpy(lse), _arrays.to_numpy(expected_lse))
        check_decode(rng, BF16, *(_arrays.to_numpy(x) for x in (q, k, v, lens)), _host(out), None)


@pytest.mark.gpu
def test_paged_plan_replays_in_a_cuda_graph_with_tables_updated_in_place(rng):
    import cupy

    b, hq, hk, d, block, pages = 2, 8, 2, 64, 16, 64
    cache = cuattn.PagedKVCache(pages, block, hk, d, BF16)
    cache.k_pages[...] = cupy.asarray(randn(rng, tuple(cache.k_pages.shape), BF16))
    cache.v_pages[...] = cupy.asarray(randn(rng, tuple(cache.v_pages.shape), BF16))
    q = cupy.asarray(randn(rng, (b, 1, hq, d), BF16))
    table = cupy.zeros((b, 8), cupy.int32)
    lens = cupy.zeros(b, cupy.int32)
    with pytest.raises(TypeError, match=r"pass device arrays"):
        cuattn.plan_paged_attention(q, cache, table.get(), lens)
    plan = cuattn.plan_paged_attention(q, cache, table, lens)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run()  # warm: loads every kernel before capture
        stream.begin_capture()
        out = plan.run()
        graph = stream.end_capture()
        for step in range(3):
            table[...] = cupy.asarray(rng.permutation(pages)[:b * 8].reshape(b, 8).astype(np.int32))
            lens[...] = cupy.asarray(np.array([128 - step, 17 + 40 * step], np.int32))
            q[...] = cupy.asarray(randn(rng, tuple(q.shape), BF16))
            graph.launch(stream)
            stream.synchronize()
            # the pages gathered into contiguous rows: each row within its budget
            k_rows, v_rows = (reference.gather_pages(x.get(), table.get(), lens.get())
                              for x in (cache.k_pages, cache.v_pages))
            check_decode(rng, BF16, q.get(), k_rows, v_rows, lens.get(), out.get(), None)
