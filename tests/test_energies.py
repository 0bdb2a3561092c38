import dataclasses
import io
import math
import pickle
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import distributions as D
from torch import nn
from torch.func import grad, vmap
from torch.utils import _pytree as pytree

from fnebm import energies as E
from fnebm.gradients import score, value_and_grad

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spd(d: int, seed: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=_gen(seed), dtype=F64)
    return a @ a.T + d * torch.eye(d, dtype=F64)


def make(family: str, d: int) -> E.Energy:
    """One energy per family at dimension ``d``, float64, from fixed seeds."""
    g = _gen(d)
    if family == "gaussian_full":
        return E.gaussian(torch.randn(d, generator=g, dtype=F64), _spd(d, d))
    if family == "gaussian_diag":
        return E.gaussian(torch.randn(d, generator=g, dtype=F64), torch.rand(d, generator=g, dtype=F64) + 0.5)
    if family == "gaussian_precision":
        return E.gaussian(torch.zeros(d, dtype=F64), precision=_spd(d, d + 1))
    if family == "mixture":
        k = 3
        return E.gaussian_mixture(
            2 * torch.randn(k, d, generator=g, dtype=F64),
            torch.rand(k, d, generator=g, dtype=F64) + 0.5,
            torch.rand(k, generator=g, dtype=F64) + 0.1,
        )
    if family == "mixture_iso":
        return E.gaussian_mixture(torch.randn(2, d, generator=g, dtype=F64), torch.tensor([0.7, 1.3], dtype=F64))
    return {
        "double_well": lambda: E.double_well(1.5, 0.8, dtype=F64),
        "rosenbrock": lambda: E.rosenbrock(dtype=F64),
        "harmonic": lambda: E.harmonic(2.5, dtype=F64),
        "rastrigin": lambda: E.rastrigin(dtype=F64),
        "ackley": lambda: E.ackley(dtype=F64),
    }[family]()


FAMILIES = [
    "gaussian_full", "gaussian_diag", "gaussian_precision", "mixture", "mixture_iso",
    "double_well", "rosenbrock", "harmonic", "rastrigin", "ackley",
]


@st.composite
def points(draw, n=None):
    """(family dim, x) with x: (d,) or (n, d), float64 in [-3, 3]."""
    d = draw(st.integers(2, 4))
    shape = (d,) if n is None else (n, d)
    vals = draw(st.lists(st.floats(-3, 3), min_size=math.prod(shape), max_size=math.prod(shape)))
    return d, torch.tensor(vals, dtype=F64).reshape(shape)


# -------------------------------------------------------------------- gradients, batching


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None)
@given(dx=points())
def test_closed_form_grad_matches_autograd(family, dx):
    d, x = dx
    e = make(family, d)
    torch.testing.assert_close(e.grad(x), torch.func.grad(e)(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=5, deadline=None)
@given(dx=points(n=4))
def test_vmap_equals_loop(family, dx):
    d, xs = dx
    e = make(family, d)
    torch.testing.assert_close(torch.func.vmap(e)(xs), torch.stack([e(x) for x in xs]))
    torch.testing.assert_close(torch.func.vmap(e.grad)(xs), torch.stack([e.grad(x) for x in xs]))
    assert e(xs[0]).shape == ()


# --------------------------------------------------------------------- reference values


def test_gaussian_matches_multivariate_normal_up_to_constant():
    mean = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    cov = _spd(3, 0)
    e = E.gaussian(mean, cov)
    mvn = D.MultivariateNormal(mean, covariance_matrix=cov)
    xs = torch.randn(5, 3, generator=_gen(1), dtype=F64)
    energies = torch.func.vmap(e)(xs)
    torch.testing.assert_close(energies - energies[0], -(mvn.log_prob(xs) - mvn.log_prob(xs[0])))
    assert e(mean) == 0


def test_gaussian_forms_agree():
    mean = torch.tensor([1.0, -2.0, 0.0], dtype=F64)
    var = torch.tensor([0.5, 2.0, 3.0], dtype=F64)
    forms = [
        E.gaussian(mean, cov=var),
        E.gaussian(mean, cov=torch.diag(var)),
        E.gaussian(mean, precision=1 / var),
        E.gaussian(mean, precision=torch.diag(1 / var)),
    ]
    xs = torch.randn(6, 3, generator=_gen(2), dtype=F64)
    ref = torch.func.vmap(forms[0])(xs)
    for e in forms[1:]:
        torch.testing.assert_close(torch.func.vmap(e)(xs), ref)
        torch.testing.assert_close(torch.func.vmap(e.grad)(xs), torch.func.vmap(forms[0].grad)(xs))
    full = _spd(3, 3)
    torch.testing.assert_close(
        torch.func.vmap(E.gaussian(mean, cov=full))(xs),
        torch.func.vmap(E.gaussian(mean, precision=torch.linalg.inv(full)))(xs),
    )
    ident = E.gaussian(mean)
    torch.testing.assert_close(ident(xs[0]), 0.5 * ((xs[0] - mean) ** 2).sum())


@pytest.mark.parametrize("family", ["mixture", "mixture_iso"])
def test_mixture_equals_mixture_same_family(family):
    e = make(family, 3)
    comp = D.Independent(D.Normal(e.means, e.scales), 1)
    ref = D.MixtureSameFamily(D.Categorical(probs=e.weights), comp)
    xs = 2 * torch.randn(8, 3, generator=_gen(3), dtype=F64)
    torch.testing.assert_close(torch.func.vmap(e)(xs), -ref.log_prob(xs))


def test_mixture_weights_normalised_and_default_uniform():
    means = torch.tensor([[0.0, 0.0], [3.0, 3.0]], dtype=F64)
    scaled = E.gaussian_mixture(means, torch.ones(2, dtype=F64), torch.tensor([2.0, 6.0], dtype=F64))
    torch.testing.assert_close(scaled.weights, torch.tensor([0.25, 0.75], dtype=F64))
    uniform = E.gaussian_mixture(means, torch.ones(2, dtype=F64))
    torch.testing.assert_close(uniform.weights, torch.tensor([0.5, 0.5], dtype=F64))


def test_double_well_known_values():
    h, b, d = 1.5, 0.8, 3
    e = E.double_well(h, b, dtype=F64)
    torch.testing.assert_close(e(torch.zeros(d, dtype=F64)), torch.tensor(h * d * b**4, dtype=F64))
    torch.testing.assert_close(e(torch.full((d,), -b, dtype=F64)), torch.tensor(0.0, dtype=F64))
    default = E.double_well(dtype=F64)  # h=2, b=1
    torch.testing.assert_close(default(torch.tensor([2.0, 0.0], dtype=F64)), torch.tensor(20.0, dtype=F64))


def test_other_families_known_values():
    x = torch.tensor([1.0, 2.0], dtype=F64)
    torch.testing.assert_close(E.harmonic(2.0, dtype=F64)(x), torch.tensor(5.0, dtype=F64))
    torch.testing.assert_close(E.rosenbrock(dtype=F64)(x), torch.tensor(100.0 * (2 - 1) ** 2, dtype=F64))
    assert E.rosenbrock(dtype=F64)(torch.ones(4, dtype=F64)) == 0
    assert E.rastrigin(dtype=F64)(torch.zeros(3, dtype=F64)) == 0
    torch.testing.assert_close(E.ackley(dtype=F64)(torch.zeros(3, dtype=F64)), torch.tensor(0.0, dtype=F64))


def test_ackley_finite_with_zero_gradient_at_origin():
    for dtype in (torch.float32, F64):
        e, x = E.ackley(dtype=dtype), torch.zeros(4, dtype=dtype)
        assert torch.isfinite(e(x))
        for g in (torch.func.grad(e)(x), e.grad(x)):
            assert torch.equal(g, torch.zeros_like(x))


# ------------------------------------------------------------------------- dtype, device


def test_dtype_device_and_to():
    e = E.harmonic()
    assert e.dtype == torch.get_default_dtype() and e.device == torch.device("cpu")
    e64 = e.to(dtype=F64)
    assert e64.dtype == F64 and e64.k.dtype == F64 and e.dtype == torch.get_default_dtype()
    g = E.gaussian(torch.zeros(2, dtype=F64), _spd(2, 0))
    assert g.dtype == F64
    g32 = g.to(dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in (g32.mean, g32.precision, g32.precision_tril))
    assert E.gaussian(torch.zeros(2, dtype=torch.int64)).dtype == torch.get_default_dtype()
    assert E.gaussian([0.0, 1.0], dtype=F64).dtype == F64
    assert E.rastrigin(torch.tensor(3.0, dtype=F64)).dtype == F64
    assert E.ackley(device="cpu").device == torch.device("cpu")


def test_dim_and_check_dim():
    assert make("gaussian_full", 3).dim == 3 and make("mixture", 2).dim == 2
    assert E.harmonic().dim is None and E.rosenbrock().dim is None
    E.harmonic().check_dim(1)
    E.rosenbrock().check_dim(2)
    with pytest.raises(ValueError, match="rosenbrock takes dim >= 2"):
        E.rosenbrock().check_dim(1)
    with pytest.raises(ValueError, match="gaussian takes dim == 3"):
        make("gaussian_diag", 3).check_dim(4)
    with pytest.raises(ValueError, match="gaussian_mixture takes dim == 2"):
        make("mixture", 2).check_dim(3)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        E.harmonic().check_dim(0)
    with pytest.raises(TypeError, match="dim must be an int"):
        E.harmonic().check_dim("3")


# ------------------------------------------------------------------------ neural energies


def _mlp(out: int = 1) -> nn.Module:
    # skip_init: the default init would draw from the global RNG
    net = nn.Sequential(
        nn.utils.skip_init(nn.Linear, 3, 8, dtype=F64), nn.Tanh(), nn.utils.skip_init(nn.Linear, 8, out, dtype=F64)
    )
    g = _gen(4)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=F64))
    return net


def test_from_module_energy_and_param_grad():
    net = _mlp()
    energy_fn, params = E.from_module(net)
    assert set(params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not any(p.requires_grad for p in params.values())
    xs = torch.randn(4, 3, generator=_gen(5), dtype=F64)
    out = energy_fn(params, xs[0])
    assert out.shape == ()
    torch.testing.assert_close(out, net(xs[0][None]).squeeze())
    torch.testing.assert_close(torch.func.vmap(energy_fn, in_dims=(None, 0))(params, xs), net(xs).squeeze(-1))

    param_grads = torch.func.grad(energy_fn)(params, xs[0])
    ref = torch.autograd.grad(net(xs[0][None]).squeeze(), list(net.parameters()))
    for (name, _), r in zip(net.named_parameters(), ref):
        torch.testing.assert_close(param_grads[name], r)


def test_from_module_includes_buffers_and_rejects_vector_output():
    net = nn.Sequential(_mlp(), nn.BatchNorm1d(1, dtype=F64).eval())
    _, params = E.from_module(net)
    assert "1.running_mean" in params
    energy_fn, params = E.from_module(_mlp(out=2))
    with pytest.raises(ValueError, match="one energy per sample"):
        energy_fn(params, torch.zeros(3, dtype=F64))


def test_bind():
    net = _mlp()
    energy_fn, params = E.from_module(net)
    e = E.bind(energy_fn, params)
    x = torch.tensor([0.1, -0.2, 0.3], dtype=F64)
    assert e.dtype == F64 and e.device == torch.device("cpu") and e.dim is None
    torch.testing.assert_close(e(x), energy_fn(params, x))
    assert torch.func.grad(e)(x).shape == (3,)
    assert e.to(dtype=torch.float32).dtype == torch.float32
    assert E.bind(lambda p, x: (x * x).sum(), {}).dtype is None


# --------------------------------------------------------------------- gradient helpers


def test_value_and_grad_and_score():
    e = E.harmonic(2.0, dtype=F64)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    value, grad = value_and_grad(e)(x)
    torch.testing.assert_close(value, e(x))
    torch.testing.assert_close(grad, 2.0 * x)
    torch.testing.assert_close(score(e)(x), -2.0 * x)
    xs = torch.randn(5, 3, generator=_gen(6), dtype=F64)
    values, grads = torch.func.vmap(value_and_grad(e))(xs)
    torch.testing.assert_close(values, torch.func.vmap(e)(xs))
    torch.testing.assert_close(grads, torch.func.vmap(e.grad)(xs))
    torch.testing.assert_close(torch.func.vmap(score(e))(xs), -grads)


@pytest.mark.compile
def test_every_family_compiles_fullgraph_and_matches_eager():
    # One graph holds every family's autograd value_and_grad and closed-form grad: one compile.
    xs = torch.randn(6, 3, generator=_gen(7), dtype=F64)
    energies = [make(f, 3) for f in FAMILIES]

    def all_grads(x):
        out = []
        for e in energies:
            out += [*torch.func.vmap(value_and_grad(e))(x), torch.func.vmap(e.grad)(x)]
        return out

    compiled = torch.compile(all_grads, fullgraph=True)
    for got, want in zip(compiled(xs), all_grads(xs), strict=True):
        torch.testing.assert_close(got, want)


# -------------------------------------------------------------------------- bad inputs

EYE2 = torch.eye(2)

BAD = [
    (lambda: E.gaussian(torch.zeros(2, 2)), ValueError, "mean must be 1-D"),
    (lambda: E.gaussian(torch.zeros(0)), ValueError, "mean must have at least one"),
    (lambda: E.gaussian([0.0, float("nan")]), ValueError, "mean must be finite"),
    (lambda: E.gaussian("abc"), TypeError, "mean must be"),
    (lambda: E.gaussian(None), TypeError, "mean must be"),
    (lambda: E.gaussian(torch.zeros(2), EYE2, EYE2), ValueError, "cov and precision"),
    (lambda: E.gaussian(torch.zeros(2), torch.ones(2, 3)), ValueError, r"cov must have shape \(2, 2\)"),
    (lambda: E.gaussian(torch.zeros(3), EYE2), ValueError, r"cov must have shape \(3, 3\)"),
    (lambda: E.gaussian(torch.zeros(2), torch.ones(3)), ValueError, r"cov must have shape \(2,\)"),
    (lambda: E.gaussian(torch.zeros(2), torch.ones(2, 2, 2)), ValueError, "cov must be 1-D or 2-D"),
    (lambda: E.gaussian(torch.zeros(2), torch.tensor([[1.0, 0.5], [0.0, 1.0]])), ValueError, "cov must be symmetric"),
    (lambda: E.gaussian(torch.zeros(2), torch.tensor([[1.0, 2.0], [2.0, 1.0]])), ValueError,
     "cov must be positive definite"),
    (lambda: E.gaussian(torch.zeros(2), torch.tensor([1.0, 0.0])), ValueError, "cov must be > 0"),
    (lambda: E.gaussian(torch.zeros(2), precision=-EYE2), ValueError, "precision must be positive definite"),
    (lambda: E.gaussian(torch.zeros(2), precision=torch.tensor([1.0, -1.0])), ValueError, "precision must be > 0"),
    (lambda: E.gaussian(torch.zeros(2), dtype=torch.int64), TypeError, "dtype must be a floating"),
    (lambda: E.double_well(barrier_height=0.0), ValueError, "barrier_height must be a finite number > 0"),
    (lambda: E.double_well(b=float("inf")), ValueError, "b must be finite"),
    (lambda: E.double_well(b="1"), TypeError, "b must be a real number"),
    (lambda: E.rosenbrock(b=0.0), ValueError, "b must be a finite number > 0"),
    (lambda: E.rosenbrock(a=float("nan")), ValueError, "a must be finite"),
    (lambda: E.harmonic(k=-1.0), ValueError, "k must be a finite number > 0"),
    (lambda: E.harmonic(k=True), TypeError, "k must be a real number"),
    (lambda: E.harmonic(k=1j), TypeError, "k must be a real number"),
    (lambda: E.harmonic(k=[1.0, 2.0]), ValueError, "k must be 0-D"),
    (lambda: E.rastrigin(a=-0.5), ValueError, "a must be a finite number >= 0"),
    (lambda: E.ackley(b=0.0), ValueError, "b must be a finite number > 0"),
    (lambda: E.ackley(a=-1.0), ValueError, "a must be a finite number >= 0"),
    (lambda: E.ackley(c=object()), TypeError, "c must be a real number"),
    (lambda: E.gaussian_mixture(torch.zeros(2), torch.ones(2)), ValueError, "means must be 2-D"),
    (lambda: E.gaussian_mixture(torch.zeros(0, 2), torch.ones(0)), ValueError, r"means must have shape \(K, d\)"),
    (lambda: E.gaussian_mixture(torch.zeros(2, 3), torch.ones(3)), ValueError, r"scales must have shape \(2,\)"),
    (lambda: E.gaussian_mixture(torch.zeros(2, 3), torch.ones(2, 2)), ValueError, r"or \(2, 3\)"),
    (lambda: E.gaussian_mixture(torch.zeros(2, 3), torch.tensor([1.0, 0.0])), ValueError, "scales must be > 0"),
    (lambda: E.gaussian_mixture(torch.zeros(2, 3), torch.ones(2), torch.ones(3)), ValueError,
     r"weights must have shape \(2,\)"),
    (lambda: E.gaussian_mixture(torch.zeros(2, 3), torch.ones(2), torch.tensor([1.0, -1.0])), ValueError,
     "weights must be > 0"),
    (lambda: E.gaussian_mixture(torch.zeros(2, 3), "wide"), TypeError, "scales must be"),
    (lambda: E.from_module(lambda x: x), TypeError, "module must be a torch.nn.Module"),
    (lambda: E.bind(3, {}), TypeError, "energy_fn must be callable"),
    (lambda: value_and_grad(3), TypeError, "energy must be callable"),
    (lambda: score(None), TypeError, "energy must be callable"),
    (lambda: E.harmonic().to(dtype=torch.int32), TypeError, "dtype must be a floating"),
    (lambda: E.from_logdensity(3), TypeError, "logdensity_fn must be callable"),
    (lambda: E.from_logdensity(lambda x: x).check_dim(0), ValueError, "dim must be >= 1"),
]


@pytest.mark.parametrize("call, error, match", BAD)
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ------------------------------------------------------------------ energies are pytrees


def _field_values(e):
    return [getattr(e, f.name) for f in dataclasses.fields(e)]


def _stack(energies):
    """One energy whose leaves carry a leading axis: the given energies, stacked."""
    return pytree.tree_map(lambda *ts: torch.stack(ts), *energies)


def _variants(e, n=3):
    """``n`` energies of ``e``'s family and shapes, with different parameter values."""
    return [pytree.tree_map(lambda t: t * (1 + 0.25 * i), e) for i in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_energy_is_a_pytree_of_its_parameters(family):
    e = make(family, 3)
    leaves, spec = pytree.tree_flatten(e)
    assert len(leaves) == len(_field_values(e))
    assert all(a is b for a, b in zip(leaves, _field_values(e), strict=True))
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is type(e) and rebuilt is not e
    assert all(a is b for a, b in zip(_field_values(rebuilt), _field_values(e), strict=True))
    x = torch.tensor([0.3, -1.2, 0.7], dtype=F64)
    assert torch.equal(rebuilt(x), e(x)) and torch.equal(rebuilt.grad(x), e.grad(x))
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(e)[0]]
    assert paths == [f".{f.name}" for f in dataclasses.fields(e)]
    assert pytree.tree_structure(pytree.tree_map(torch.zeros_like, e)) == spec


@pytest.mark.parametrize("family", FAMILIES)
def test_vmap_over_stacked_energies_equals_loop(family):
    es = _variants(make(family, 3))
    batched = _stack(es)
    x = torch.tensor([0.3, -1.2, 0.7], dtype=F64)
    xs = torch.randn(3, 3, generator=_gen(8), dtype=F64)
    values = vmap(lambda e, x: e(x), in_dims=(0, None))(batched, x)
    assert values.shape == (3,)
    torch.testing.assert_close(values, torch.stack([e(x) for e in es]))
    torch.testing.assert_close(
        vmap(lambda e, x: e.grad(x), in_dims=(0, None))(batched, x), torch.stack([e.grad(x) for e in es])
    )
    # energies and positions mapped together: one energy per chain
    torch.testing.assert_close(vmap(lambda e, x: e(x))(batched, xs), torch.stack([e(x) for e, x in zip(es, xs)]))


def test_vmap_over_harmonic_stiffness():
    batched = E.Harmonic(torch.tensor([1.0, 2.0, 3.0], dtype=F64))  # a vmapped energy sees 0-dim k
    x = torch.tensor([1.0, 2.0], dtype=F64)
    energies_at = vmap(lambda e, x: e(x), in_dims=(0, None))
    torch.testing.assert_close(energies_at(batched, x), torch.tensor([2.5, 5.0, 7.5], dtype=F64))
    backend = CountingBackend()
    compiled = torch.compile(energies_at, fullgraph=True, backend=backend)
    for k in ([1.0, 2.0, 3.0], [0.5, 0.25, 4.0]):
        batched = E.Harmonic(torch.tensor(k, dtype=F64))
        torch.testing.assert_close(compiled(batched, x), energies_at(batched, x))
    assert backend.graphs == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_grad_over_energy_is_energy_shaped_and_matches_autograd(family):
    e = make(family, 3)
    x = torch.tensor([0.3, -1.2, 0.7], dtype=F64)
    g = grad(lambda e, x: e(x))(e, x)
    assert type(g) is type(e)
    leaves = [t.clone().requires_grad_() for t in pytree.tree_leaves(e)]
    value = pytree.tree_unflatten(leaves, pytree.tree_structure(e))(x)
    ref = torch.autograd.grad(value, leaves, allow_unused=True)
    for got, want, leaf in zip(pytree.tree_leaves(g), ref, leaves, strict=True):
        torch.testing.assert_close(got, torch.zeros_like(leaf) if want is None else want)


def test_parameter_gradients_in_closed_form():
    x = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    energy_grad = grad(lambda e, x: e(x))
    torch.testing.assert_close(energy_grad(E.harmonic(2.0, dtype=F64), x).k, 0.5 * (x * x).sum())
    h, b = 1.5, 0.8
    g = energy_grad(E.double_well(h, b, dtype=F64), x)
    torch.testing.assert_close(g.barrier_height, ((x * x - b**2) ** 2).sum())
    torch.testing.assert_close(g.b, (h * 2 * (x * x - b**2) * (-2 * b)).sum())
    gauss = make("gaussian_full", 3)
    g = energy_grad(gauss, x)
    torch.testing.assert_close(g.mean, -gauss.grad(x))  # dE/dmean = -P (x - mean)
    delta = x - gauss.mean
    torch.testing.assert_close(g.precision_tril, torch.outer(delta, delta @ gauss.precision_tril))
    assert [f.name for f in dataclasses.fields(g)] == ["mean", "precision_tril"]  # P is derived, not a leaf


@pytest.mark.parametrize("family", ["gaussian_full", "gaussian_diag"])
def test_gaussian_precision_follows_its_factor_through_training(family):
    # The precision is derived from L, so a gradient step on the leaves (mean, L) moves the energy,
    # the closed-form grad and the precision together (a stored P used to keep its first value).
    gauss = make(family, 3)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    g = grad(lambda e, x: e(x))(gauss, x)
    trained = pytree.tree_map(lambda p, d: p - 0.1 * d, gauss, g)
    L = trained.precision_tril
    P = L * L if family == "gaussian_diag" else L @ L.T
    assert not torch.allclose(P, gauss.precision)  # the step moved the precision
    torch.testing.assert_close(trained.precision, P, rtol=0, atol=0)
    torch.testing.assert_close(trained.grad(x), grad(trained)(x))  # closed form == autograd of the call
    torch.testing.assert_close(trained.grad(x), (x - trained.mean) @ (torch.diag(P) if P.ndim == 1 else P))
    ref = E.gaussian(trained.mean, precision=P)  # the checked constructor agrees
    torch.testing.assert_close(ref(x), trained(x))
    torch.testing.assert_close(ref.grad(x), trained.grad(x))
    # the older three-argument form still builds the same energy (its P is dropped: P is L L^T)
    old = E.Gaussian(trained.mean, torch.zeros_like(P), L)
    assert torch.equal(old.precision, trained.precision) and torch.equal(old.grad(x), trained.grad(x))
    with pytest.raises(TypeError, match="precision_tril"):
        E.Gaussian(trained.mean)
    # a file saved before the change (a stale P in the instance's dict) loads with the derived P
    stale = E.Gaussian(trained.mean, L)
    stale.__dict__["precision"] = gauss.precision
    buf = io.BytesIO()
    torch.save(stale, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert torch.equal(loaded.precision, P)
    torch.testing.assert_close(loaded.grad(x), trained.grad(x))
    leaves = pytree.tree_leaves(loaded)
    assert len(leaves) == 2 and leaves[0] is loaded.mean and leaves[1] is loaded.precision_tril


# ------------------------------------------------------------------------- BoundEnergy


def _mlp2(seed: int = 0) -> nn.Module:
    net = nn.Sequential(
        nn.utils.skip_init(nn.Linear, 2, 8, dtype=F64), nn.Tanh(), nn.utils.skip_init(nn.Linear, 8, 1, dtype=F64)
    )
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=_gen(seed + p.numel()), dtype=F64))
    return net


def _new_params(params, seed):
    g = _gen(seed)
    return {k: 0.5 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}


def test_bound_energy_is_a_pytree_of_its_params():
    energy_fn, params = E.from_module(_mlp2())
    e = E.bind(energy_fn, params)
    leaves, spec = pytree.tree_flatten(e)
    assert all(a is b for a, b in zip(leaves, params.values(), strict=True))
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, E.BoundEnergy) and rebuilt.energy_fn is energy_fn
    x = torch.tensor([0.4, -0.3], dtype=F64)
    assert torch.equal(rebuilt(x), e(x))
    assert [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(e)[0]] == [
        f".params[{k!r}]" for k in params
    ]

    g = grad(lambda e, x: e(x))(e, x)
    assert isinstance(g, E.BoundEnergy) and g.energy_fn is energy_fn
    want = grad(energy_fn)(params, x)
    for k in params:
        torch.testing.assert_close(g.params[k], want[k])

    es = [E.bind(energy_fn, _new_params(params, s)) for s in range(3)]
    torch.testing.assert_close(
        vmap(lambda e, x: e(x), in_dims=(0, None))(_stack(es), x), torch.stack([e(x) for e in es])
    )


# ----------------------------------------------------------- one graph across parameters


class CountingBackend:
    """A torch.compile backend that counts the graphs Dynamo hands it and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _same_shape_energies(kind):
    """Four energies of one family, same shapes, different parameter values."""
    if kind == "gaussian_precision":
        return [E.gaussian(torch.randn(2, generator=_gen(s), dtype=F64), precision=_spd(2, s)) for s in range(4)]
    if kind == "double_well":
        return [E.double_well(1.0 + s, 0.5 + 0.25 * s, dtype=F64) for s in range(4)]
    if kind == "mixture":
        return [
            E.gaussian_mixture(
                torch.randn(3, 2, generator=_gen(s), dtype=F64),
                torch.rand(3, 2, generator=_gen(s + 10), dtype=F64) + 0.5,
                torch.rand(3, generator=_gen(s + 20), dtype=F64) + 0.1,
            )
            for s in range(4)
        ]
    energy_fn, params = E.from_module(_mlp2())  # one module; new params dicts
    return [E.bind(energy_fn, _new_params(params, s)) for s in range(4)]


@pytest.mark.parametrize("kind", ["gaussian_precision", "double_well", "mixture", "bound"])
def test_new_parameter_values_reuse_the_compiled_graph(kind):
    def value_and_x_grad(e, x):
        return e(x), grad(e)(x)

    backend = CountingBackend()
    compiled = torch.compile(value_and_x_grad, fullgraph=True, backend=backend)
    x = torch.tensor([0.4, -0.3], dtype=F64)
    results = []
    for e in _same_shape_energies(kind):
        got = compiled(e, x)
        for a, b in zip(got, value_and_x_grad(e, x), strict=True):
            torch.testing.assert_close(a, b)
        results.append(got[0])
    assert backend.graphs == 1
    assert len({float(v) for v in results}) == 4  # the values were read, not baked in


# ----------------------------------------------------- constructors inside compiled code

_P2 = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=F64)
CONSTRUCT = {
    "gaussian_cov": (lambda m, x: E.gaussian(m, 2 * torch.eye(2, dtype=F64))(x),
                     lambda i: torch.tensor([0.5 * i, -i], dtype=F64)),
    "gaussian_precision": (lambda m, x: E.gaussian(m, precision=_P2)(x),
                           lambda i: torch.tensor([i, 1.0], dtype=F64)),
    "double_well": (lambda h, x: E.double_well(h, 0.5 * h)(x), lambda i: torch.tensor(1.0 + i, dtype=F64)),
    "harmonic": (lambda k, x: E.harmonic(k)(x), lambda i: torch.tensor(1.0 + i, dtype=F64)),
    "mixture": (lambda m, x: E.gaussian_mixture(m, torch.full((2,), 0.5, dtype=F64),
                                                torch.tensor([1.0, 3.0], dtype=F64))(x),
                lambda i: torch.tensor([[0.0, i], [1.0, -i]], dtype=F64)),
}


@pytest.mark.parametrize("case", list(CONSTRUCT))
def test_constructors_trace_fullgraph_without_recompiling(case):
    fn, value = CONSTRUCT[case]
    backend = CountingBackend()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    x = torch.tensor([0.4, -0.3], dtype=F64)
    for i in range(3):
        torch.testing.assert_close(compiled(value(0.5 * i), x), fn(value(0.5 * i), x))
    assert backend.graphs == 1


def test_constructor_checks_under_compile_and_transforms():
    x = torch.tensor([1.0, 2.0], dtype=F64)
    # values are not read while tracing: the checks are skipped, not turned into syncs
    negative = torch.compile(lambda k, x: E.harmonic(k)(x), fullgraph=True, backend=CountingBackend())
    torch.testing.assert_close(negative(torch.tensor(-1.0, dtype=F64), x), torch.tensor(-2.5, dtype=F64))
    with pytest.raises(ValueError, match="k must be a finite number > 0, got -1.0"):
        E.harmonic(torch.tensor(-1.0, dtype=F64))
    # metadata (shapes) is checked everywhere; Dynamo reports it as an exception it observed
    bad_shape = lambda m, x: E.gaussian(m, torch.ones(3, 3, dtype=F64))(x)  # noqa: E731
    with pytest.raises(ValueError, match=r"cov must have shape \(2, 2\)"):
        torch.compile(bad_shape, backend=CountingBackend())(torch.zeros(2, dtype=F64), x)
    with pytest.raises(Exception, match=r"cov must have shape \(2, 2\)"):
        torch.compile(bad_shape, fullgraph=True, backend=CountingBackend())(torch.zeros(2, dtype=F64), x)
    # under torch.func the parameter is data: vmap and grad flow through the constructor
    ks = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    torch.testing.assert_close(vmap(lambda k: E.harmonic(k)(x))(ks), 0.5 * ks * (x * x).sum())
    m, cov = torch.tensor([0.3, -0.1], dtype=F64), _spd(2, 5)
    torch.testing.assert_close(grad(lambda m: E.gaussian(m, cov)(x))(m), -E.gaussian(m, cov).grad(x))


# ---------------------------------------------------------------------- from_logdensity


def test_from_logdensity_negates_the_log_density():
    mean, cov = torch.tensor([0.5, -1.0], dtype=F64), _spd(2, 9)
    prec = torch.linalg.inv(cov)
    log_norm = -0.5 * (torch.logdet(2 * math.pi * cov))

    def logdensity(x):  # BlackJAX style: x -> log p(x)
        d = x - mean
        return log_norm - 0.5 * d @ prec @ d

    e, ref = E.from_logdensity(logdensity), E.gaussian(mean, cov)
    xs = torch.randn(6, 2, generator=_gen(10), dtype=F64)
    # E = -log p = the Gaussian energy plus a constant (the log normaliser)
    torch.testing.assert_close(vmap(e)(xs) - vmap(ref)(xs), torch.full((6,), -float(log_norm), dtype=F64))
    torch.testing.assert_close(vmap(grad(e))(xs), vmap(ref.grad)(xs))
    assert e(mean) < e(mean + 1)  # the mode has the lowest energy
    assert e.dtype is None and e.device is None and e.dim is None and e.to(dtype=torch.float32) is e
    e.check_dim(5)
    leaves, spec = pytree.tree_flatten(e)
    assert leaves == []
    assert pytree.tree_unflatten([], spec).logdensity_fn is logdensity


# ------------------------------------------------------------------------ save and load


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_save_load_weights_only(family):
    e = make(family, 3)
    buf = io.BytesIO()
    torch.save(e, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True, torch's default
    assert type(loaded) is type(e)
    for a, b in zip(_field_values(loaded), _field_values(e), strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    x = torch.tensor([0.3, -1.2, 0.7], dtype=F64)
    assert torch.equal(loaded(x), e(x)) and loaded.dim == e.dim


def test_save_bound_energy_as_params_or_leaves():
    energy_fn, params = E.from_module(_mlp2())
    e = E.bind(energy_fn, params)
    buf = io.BytesIO()
    torch.save(e, buf)  # from_module's energy_fn holds the module: it pickles, but weights_only never loads it
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf)
    x = torch.tensor([0.4, -0.3], dtype=F64)
    buf = io.BytesIO()
    torch.save(e.params, buf)
    buf.seek(0)
    assert torch.equal(E.bind(energy_fn, torch.load(buf))(x), e(x))
    leaves, spec = pytree.tree_flatten(e)
    buf = io.BytesIO()
    torch.save(leaves, buf)
    buf.seek(0)
    assert torch.equal(pytree.tree_unflatten(torch.load(buf), spec)(x), e(x))


# -------------------------------------------------------------- user-defined energies


@dataclass(frozen=True, eq=False)
class Quartic(E.Energy):
    """A user's family: ``scale * sum(x^power)``; ``power`` is static (not a parameter)."""

    scale: torch.Tensor
    power: int = E.static_field(default=4)
    name: ClassVar[str] = "quartic"

    def __call__(self, x):
        return self.scale * (x**self.power).sum(-1)


@dataclass(frozen=True, eq=False, slots=True)
class SlottedHarmonic(E.Energy):
    k: torch.Tensor

    def __call__(self, x):
        return 0.5 * self.k * (x * x).sum(-1)


class NotATree(E.Energy, pytree=False):
    def __call__(self, x):
        return (x * x).sum(-1)


def test_user_subclass_is_registered_when_defined():
    x = torch.tensor([1.0, 2.0], dtype=F64)
    q = Quartic(torch.tensor(0.5, dtype=F64), power=2)
    leaves, spec = pytree.tree_flatten(q)
    assert leaves == [q.scale]
    rebuilt = pytree.tree_unflatten([torch.tensor(2.0, dtype=F64)], spec)
    assert type(rebuilt) is Quartic and rebuilt.power == 2 and rebuilt(x) == 10.0
    assert pytree.tree_structure(Quartic(q.scale, power=3)) != spec  # static values are structure
    g = grad(lambda e, x: e(x))(q, x)
    assert type(g) is Quartic and g.power == 2 and g.scale == 5.0
    qs = _stack([Quartic(torch.tensor(s, dtype=F64), power=2) for s in (1.0, 2.0)])
    torch.testing.assert_close(vmap(lambda e, x: e(x), in_dims=(0, None))(qs, x), torch.tensor([5.0, 10.0], dtype=F64))
    assert q.to(dtype=torch.float32).scale.dtype == torch.float32 and q.to(dtype=torch.float32).power == 2

    backend = CountingBackend()
    compiled = torch.compile(lambda e, x: (e(x), grad(e)(x)), fullgraph=True, backend=backend)
    for s in (1.0, 2.0, 3.0):
        torch.testing.assert_close(compiled(Quartic(torch.tensor(s, dtype=F64)), x)[0], s * (x**4).sum())
    assert backend.graphs == 1

    slotted = SlottedHarmonic(torch.tensor(3.0, dtype=F64))  # @dataclass(slots=True) makes a new class
    assert pytree.tree_leaves(slotted) == [slotted.k]
    assert type(pytree.tree_map(lambda t: t + 1, slotted)) is SlottedHarmonic
    plain = NotATree()  # opted out: a leaf itself
    assert pytree.tree_leaves(plain) == [plain]


def test_user_subclass_loads_only_once_allow_listed():
    q = Quartic(torch.tensor(0.5, dtype=F64), power=2)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Quartic"):
        torch.load(buf)
    buf.seek(0)
    with torch.serialization.safe_globals([Quartic]):
        loaded = torch.load(buf)
    assert type(loaded) is Quartic and loaded.power == 2 and torch.equal(loaded.scale, q.scale)
