"""cuattn.torch: the autograd op against torch SDPA's autograd, and under torch.compile.

GPU tests with torch CUDA tensors; fresh random inputs every run.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn import reference
from conftest import BF16, check_varlen_gradients, error_budget, prefix_sums

pytestmark = pytest.mark.gpu


def _sdpa(torch, q, k, v, **options):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True, **options).transpose(1, 2)


def _leaves(torch, seed, shapes):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
            for shape in shapes]


def _gradients_against_sdpa(torch, rng, shapes, causal, call):
    """Gradients of ``call`` (cuattn.torch.attention, or a compiled one) and of torch SDPA on the
    same leaves of ``shapes`` (q, k, v) and dout, each against the float64 reference backward:
    cuattn's error at most 3x the larger of SDPA's and the naive backward's (the 3x rule), each
    gradient in its leaf's shape."""
    ours = _leaves(torch, rng.seed, shapes)
    theirs = [x.detach().clone().requires_grad_() for x in ours]
    dout = torch.randn((*shapes[0][:-1], shapes[2][-1]), device="cuda", dtype=torch.bfloat16)
    out = call(*ours, causal=causal)
    assert out.shape == dout.shape
    out.backward(dout)
    _sdpa(torch, *theirs, is_causal=causal).backward(dout)

    to64 = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    q, k, v = (to64(x) for x in ours)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    refs = reference.attention_backward(to64(dout), q, k, v, ref_out, ref_lse, causal=causal)
    naives = reference.naive_attention_backward_lowp(to64(dout), q, k, v, causal=causal, dtype=BF16)
    for name, a, b, ref, naive in zip(("dq", "dk", "dv"), ours, theirs, refs, naives):
        assert a.grad.shape == a.shape, name
        ours_err = np.abs(to64(a.grad) - ref).max()
        torch_err = np.abs(to64(b.grad) - ref).max()
        # the 3x rule, over the larger of the naive backward's error and torch's
        budget = error_budget(max(np.abs(naive - ref).max(), torch_err), BF16, 3.0, np.abs(ref).max())
        assert ours_err <= budget, f"{name}: cuattn {ours_err:.3g} vs torch {torch_err:.3g} (seed {rng.seed})"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradients_match_torch_sdpa_within_the_error_rule(rng, causal):
    torch = pytest.importorskip("torch")
    import cuattn.torch

    shapes = [(2, 333, 8, 64), (2, 333, 2, 64), (2, 333, 2, 64)]
    _gradients_against_sdpa(torch, rng, shapes, causal, cuattn.torch.attention)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_v_head_dim_of_its_own_matches_torch_sdpa(rng, compiled):
    """D = 192, Dv = 128 (DeepSeek's prefill): out and v.grad are Dv wide, q.grad and k.grad D wide."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    shapes = [(2, 133, 8, 192), (2, 133, 2, 192), (2, 133, 2, 128)]
    call = torch.compile(cuattn.torch.attention, fullgraph=True) if compiled else cuattn.torch.attention
    _gradients_against_sdpa(torch, rng, shapes, True, call)


def test_compiles_without_a_graph_break(rng):
    """fullgraph=True raises on a graph break: the custom ops and their fake kernels must trace.
    With the deterministic backward, compiled and eager gradients are bit-identical."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    def loss(q, k, v):
        return cuattn.torch.attention(q, k, v, causal=True, softcap=30.0, deterministic=True).float().square().mean()

    shapes = [(1, 257, 4, 128), (1, 257, 4, 128), (1, 257, 4, 128)]
    eager = _leaves(torch, rng.seed, shapes)
    compiled_inputs = [x.detach().clone().requires_grad_() for x in eager]
    loss(*eager).backward()
    torch.compile(loss, fullgraph=True)(*compiled_inputs).backward()
    for a, b in zip(eager, compiled_inputs):
        assert torch.equal(a.grad, b.grad)


def test_an_expanded_or_sliced_gradient_is_accepted(rng):
    """out.sum() hands back a stride-0 gradient; a slice of a wider tensor an unaligned one."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    q, k, v = _leaves(torch, rng.seed, [(1, 65, 2, 64)] * 3)
    cuattn.torch.attention(q, k, v, causal=True).sum().backward()
    expected = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    wide = torch.cat([cuattn.torch.attention(q, k, v, causal=True), torch.zeros(1, 65, 2, 3, device="cuda",
                                                                                  dtype=torch.bfloat16)], dim=-1)
    wide[..., :64].sum().backward()
    for a, b in zip((q, k, v), expected):
        assert torch.allclose(a.grad.float(), b.float(), atol=1e-2)


def test_learnable_sinks_get_their_gradient(rng):
    """gpt-oss style: a float32 sink logit per head, trained beside q, k, v (also under
    torch.compile). The sinks' gradient and q's against the float64 reference."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    shapes = [(2, 129, 4, 64), (2, 129, 2, 64), (2, 129, 2, 64)]
    q, k, v = _leaves(torch, rng.seed, shapes)
    sinks = torch.randn(4, device="cuda", dtype=torch.float32).mul_(2).requires_grad_()
    dout = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16)
    cuattn.torch.attention(q, k, v, causal=True, sinks=sinks).backward(dout)

    to64 = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    qn, kn, vn, sn = (to64(x) for x in (q, k, v, sinks))
    ref_out, ref_lse = reference.attention(qn, kn, vn, causal=True, sinks=sn, return_lse=True)
    dq, _, _, dsinks = reference.attention_backward(to64(dout), qn, kn, vn, ref_out, ref_lse, causal=True, sinks=sn)
    np.testing.assert_allclose(to64(sinks.grad), dsinks, rtol=2e-2, atol=2e-2 * np.abs(dsinks).max())
    assert np.abs(to64(q.grad) - dq).max() <= 5e-2 * max(np.abs(dq).max(), 1.0), f"seed {rng.seed}"

    compiled = [x.detach().clone().requires_grad_() for x in (q, k, v, sinks)]
    out = torch.compile(lambda a, b, c, s: cuattn.torch.attention(a, b, c, causal=True, sinks=s), fullgraph=True)(
        *compiled)
    out.backward(dout)
    assert torch.allclose(compiled[3].grad, sinks.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("options, error, message", [
    ({"causal": "False"}, TypeError, r"causal must be a bool, got 'False'"),
    ({"window": (1.9, 0)}, TypeError, r"window must be a pair \(left, right\) of ints"),
    ({"scale": "0.5"}, TypeError, r"scale must be"),
    ({"softcap": True}, TypeError, r"softcap must be a float"),
    ({"deterministic": 1}, TypeError, r"deterministic must be a bool, got 1"),
])
def test_options_are_checked_by_name_before_the_op_converts_them(options, error, message):
    """The custom op's schema would turn "False" into True and 1.9 into 1: the options are checked
    as the plain function checks them first."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    q = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(error, match=message):
        cuattn.torch.attention(q, q, q, **options)
    with pytest.raises(TypeError, match=r"k must be a torch tensor \(cuattn.torch.attention\), got NoneType"):
        cuattn.torch.attention(q, None, q)
    # the op's schema would refuse them in its own words
    for name in ("sinks", "alibi_slopes"):
        message = rf"{name} must be a float32 torch tensor or None \(cuattn.torch.attention\), got ndarray"
        with pytest.raises(TypeError, match=message):
            cuattn.torch.attention(q, q, q, **{name: np.zeros(2, np.float32)})


@pytest.mark.parametrize("function", ["attention", "attention_varlen"])
def test_eager_calls_run_without_the_custom_ops(rng, monkeypatch, function):
    """Eager calls take the ops' bodies through a torch.autograd.Function: the custom ops'
    dispatch cost several times the kernels' host time. The ops (what torch.compile traces) are
    made to fail; the eager call and its backward still run."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    def refuse(*args):
        raise AssertionError("an eager call reached the custom op")

    for op in ("_attention_fwd", "_attention_bwd", "_attention_varlen_fwd", "_attention_varlen_bwd"):
        monkeypatch.setattr(cuattn.torch, op, refuse)
    if function == "attention":
        q, k, v = _leaves(torch, rng.seed, [(1, 65, 4, 64), (1, 65, 2, 64), (1, 65, 2, 64)])
        out = cuattn.torch.attention(q, k, v, causal=True)
    else:
        q, k, v, cu_q, cu_k, *_ = _packed(torch, rng, [5, 60], [9, 60], 4, 2, 64, 64)
        out = cuattn.torch.attention_varlen(q, k, v, cu_q, cu_k, 60, 60, causal=True)
    assert out.requires_grad and out.grad_fn is not None
    out.float().square().sum().backward()
    assert all(x.grad is not None and bool(torch.isfinite(x.grad).all()) and x.grad.abs().sum() > 0
               for x in (q, k, v))


def test_traced_calls_record_the_custom_ops(rng):
    """make_fx (a dispatch mode) records the custom op, not the eager Function's kernels."""
    torch = pytest.importorskip("torch")
    from torch.fx.experimental.proxy_tensor import make_fx

    import cuattn.torch

    q, k, v = (x.detach() for x in _leaves(torch, rng.seed, [(1, 65, 4, 64), (1, 65, 2, 64), (1, 65, 2, 64)]))
    traced = make_fx(lambda q, k, v: cuattn.torch.attention(q, k, v, causal=True))(q, k, v)
    targets = [node.target for node in traced.graph.nodes]
    assert torch.ops.cuattn.attention_fwd.default in targets, targets
    assert torch.equal(traced(q, k, v), cuattn.torch.attention(q, k, v, causal=True))


# ---------------------------------------------------------------------------------------------
# attention_varlen


def _packed(torch, rng, lens_q, lens_k, hq, hk, d, dv):
    """Leaves q (total_q, Hq, D), k (total_k, Hk, D), v (total_k, Hk, Dv), the int32 prefix sums
    on the GPU and as NumPy, and a bf16 dout."""
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    q, k, v = _leaves(torch, rng.seed, [(int(cu_q[-1]), hq, d), (int(cu_k[-1]), hk, d), (int(cu_k[-1]), hk, dv)])
    dout = torch.randn((int(cu_q[-1]), hq, dv), device="cuda", dtype=torch.bfloat16)
    return q, k, v, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(), cu_q, cu_k, dout


@pytest.mark.parametrize("extras", ["plain", "sinks", "alibi-per-sequence"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_gradients_match_the_reference(rng, causal, extras):
    """Packed sequences (one without queries, one without keys, one past a 128-row tile): dq, dk,
    dv and the sinks' gradient, each sequence under the 3x rule (per-sequence ALiBi slopes as a
    fixed bias)."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    lens_q, lens_k = [5, 0, 17, 6, 131], [9, 3, 17, 0, 140]
    q, k, v, cu_q, cu_k, cu_q_np, cu_k_np, dout = _packed(torch, rng, lens_q, lens_k, 8, 2, 64, 64)
    options = {}
    if extras == "sinks":
        options["sinks"] = torch.randn(8, device="cuda", dtype=torch.float32).mul_(2).requires_grad_()
    if extras == "alibi-per-sequence":
        options["alibi_slopes"] = torch.exp2(-torch.rand((len(lens_q), 8), device="cuda") * 7.5 - 0.5)
    out = cuattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, **options)
    assert out.shape == dout.shape
    out.backward(dout)

    to64 = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    grads = [to64(x.grad) for x in (q, k, v)] + ([to64(options["sinks"].grad)] if "sinks" in options else [])
    check_varlen_gradients(rng, BF16, to64(dout), to64(q), to64(k), to64(v), cu_q_np, cu_k_np, grads, causal=causal,
                           **{name: to64(x) for name, x in options.items()})


def test_varlen_compiles_without_a_graph_break(rng):
    """fullgraph=True over the varlen op with a v head dim of its own (D = 192, Dv = 128) and
    sinks: compiled and eager gradients bit-identical with the deterministic backward."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    lens_q, lens_k = [33, 1, 70], [40, 9, 70]
    q, k, v, cu_q, cu_k, _, _, _ = _packed(torch, rng, lens_q, lens_k, 4, 2, 192, 128)
    sinks = torch.randn(4, device="cuda", dtype=torch.float32).requires_grad_()

    def loss(q, k, v, sinks):
        out = cuattn.torch.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, sinks=sinks,
                                            deterministic=True)
        return out.float().square().mean()

    eager = (q, k, v, sinks)
    compiled_inputs = [x.detach().clone().requires_grad_() for x in eager]
    loss(*eager).backward()
    torch.compile(loss, fullgraph=True)(*compiled_inputs).backward()
    for a, b in zip(eager, compiled_inputs):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("change, error, message", [
    ({"causal": "False"}, TypeError, r"causal must be a bool, got 'False'"),
    ({"deterministic": 1}, TypeError, r"deterministic must be a bool, got 1"),
    ({"max_seqlen_q": True}, TypeError, r"max_seqlen_q must be an int >= 0, got True"),
    ({"max_seqlen_k": -1}, ValueError, r"max_seqlen_k must be an int >= 0, got -1"),
    ({"cu_seqlens_k": [0, 8]}, TypeError, r"cu_seqlens_k must be a torch tensor \(cuattn.torch.attention_varlen\), "
                                          r"got list"),
    ({"sinks": np.zeros(2, np.float32)}, TypeError, r"sinks must be a float32 torch tensor or None "
                                                    r"\(cuattn.torch.attention_varlen\), got ndarray"),
])
def test_varlen_arguments_are_checked_by_name_before_the_op_converts_them(change, error, message):
    torch = pytest.importorskip("torch")
    import cuattn.torch

    q = torch.zeros(8, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], device="cuda", dtype=torch.int32)
    arguments = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 8, "max_seqlen_k": 8}
    arguments.update(change)
    positional = [arguments.pop(name) for name in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    with pytest.raises(error, match=message):
        cuattn.torch.attention_varlen(q, q, q, *positional, **arguments)
