"""Groups spanning hosts: FlexLink inside each host, XLA's collective across (hierarchical.py).

In one process, `hosts.emulated_hosts(H)` makes the 8 host devices play H hosts of consecutive
device ids; every case compares with jax.lax on the same input (integers bitwise, float sums within
the summation-order tolerance: the hierarchical reduction order is not lax's flat one) and checks,
on the compiled HLO, that the call really ran as its legs. A 2-process job (one host each, through
FLEXLINK_HOST_ID) runs the cross-host leg over gloo.
"""
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_flexlink as flx
from jax_flexlink._src import hosts
from helpers import (abs64, assert_tree_close, assert_tree_equal, host, make_data, mesh,
                     per_device)

CROSS = "cross-host leg of a hierarchical FlexLink collective"
DEVICES = list(range(8))


def _mesh(order, shape, names):
    devs = jax.devices()
    return mesh(shape, names, [devs[i] for i in order])


# name -> (emulated hosts, device order, mesh shape, axis names, collective axes,
#          (hosts, devices per host) the collective's groups have, or None: inside one host)
CASES = {
    "1d_2hosts": (2, DEVICES, (8,), ("x",), "x", (2, 4)),
    "1d_4hosts": (4, DEVICES, (8,), ("x",), "x", (4, 2)),
    # lax's rank order alternates hosts: rank r is on host r % 2
    "1d_interleaved": (2, [0, 4, 1, 5, 2, 6, 3, 7], (8,), ("x",), "x", (2, 4)),
    "1d_permuted_4hosts": (4, [5, 2, 7, 0, 3, 6, 1, 4], (8,), ("x",), "x", (4, 2)),
    # 'x' crosses the 2 hosts (one device of each group per host), 'y' stays inside one
    "2d_x_crosses": (2, DEVICES, (2, 4), ("x", "y"), "x", (2, 1)),
    "2d_y_inside": (2, DEVICES, (2, 4), ("x", "y"), "y", None),
    "2d_both": (2, DEVICES, (2, 4), ("x", "y"), ("x", "y"), (2, 4)),
    # rank order y-major over a mesh whose 'x' is the host: hosts interleave in every group
    "2d_yx_interleaved": (2, DEVICES, (2, 4), ("x", "y"), ("y", "x"), (2, 4)),
    # 'x' spans 2 hosts with 2 of its devices on each; 4 hosts: every 'x' group on 4 hosts
    "2d_x_2hosts_m2": (2, DEVICES, (4, 2), ("x", "y"), "x", (2, 2)),
    "2d_x_4hosts": (4, DEVICES, (4, 2), ("x", "y"), "x", (4, 1)),
}


def _size(m_, axes):
    axes = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([m_.shape[a] for a in axes]))


def _body(m, axes, n):
    def body(a, b, c):  # a: (3, 5) (pads to a multiple of m), b: (2n, 3), c: (3, n)
        return (m.psum(a, axes), m.pmean(a, axes), m.pmax(a, axes), m.pmin(a, axes),
                m.all_gather(a, axes), m.all_gather(a, axes, axis=1),
                m.all_gather(a, axes, tiled=True), m.all_gather(a, axes, axis=1, tiled=True),
                m.psum_scatter(b, axes, tiled=True),
                m.psum_scatter(c, axes, scatter_dimension=1),
                m.psum_scatter(c, axes, scatter_dimension=1, tiled=True))
    return body


def _args(m_, n, dtype, seed):
    lead = tuple(m_.shape.values())
    return tuple(make_data(dtype, lead + s, seed=seed + i)
                 for i, s in enumerate([(3, 5), (2 * n, 3), (3, n)]))


def _compare(got, want, ref_abs):
    if any(jnp.issubdtype(np.asarray(w).dtype, jnp.inexact) for w in jax.tree.leaves(want)):
        assert_tree_close(got, want, ref_abs, 8)
    else:
        assert_tree_equal(got, want)


def _check_legs(report, layout):
    """The compiled program runs each collective as its legs (layout (H, m)), or, inside one host,
    as FlexLink's calls alone."""
    cross = [c for c in report if c.runner == "xla"]
    flex = [c for c in report if c.runner == "flexlink"]
    if layout is None:
        assert not cross and flex, str(report)
        return
    hosts_, m = layout
    assert cross and all(CROSS in c.reason and c.group_size == hosts_ for c in cross), str(report)
    assert {c.kind for c in cross} == {"all_reduce", "all_gather", "reduce_scatter"}, str(report)
    if m == 1:  # one device of each group per host: the in-host legs would only copy
        assert not flex, str(report)
    else:
        assert flex and all(c.group_size == m for c in flex), str(report)
        assert {c.kind for c in flex} == {"reduce_scatter", "all_gather"}, str(report)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_against_lax(case, dtype):
    count, order, shape, names, axes, layout = CASES[case]
    m_ = _mesh(order, shape, names)
    n = _size(m_, axes)
    args = _args(m_, n, dtype, seed=7)
    with hosts.emulated_hosts(count):
        want_fn = per_device(_body(lax, axes, n), m_)
        got_fn = per_device(_body(flx, axes, n), m_)
        want = host(want_fn(*args))
        got = host(got_fn(*args))
        _check_legs(flx.collectives(got_fn, *args), layout)
        ref_abs = host(want_fn(*jax.tree.map(abs64, args)))
    _compare(got, want, ref_abs)


def test_check_vma_false_and_pytree():
    """psum_p (check_vma=False) over a pytree of mixed dtypes: the merged call's legs carry every
    leaf; integers bitwise."""
    m_ = _mesh([0, 4, 1, 5, 2, 6, 3, 7], (8,), ("x",))
    tree = {"w": make_data("float32", (8, 7, 3), seed=3), "i": make_data("int32", (8, 5), seed=4),
            "h": make_data("bfloat16", (8, 2), seed=5)}

    def body(m):
        return lambda t: (m.psum(t, "x"), m.all_gather(t, "x", tiled=True))

    with hosts.emulated_hosts(2):
        want = host(per_device(body(lax), m_, check_vma=False)(tree))
        fn = per_device(body(flx), m_, check_vma=False)
        got = host(fn(tree))
        report = flx.collectives(fn, tree)
        ref_abs = host(per_device(body(lax), m_, check_vma=False)(jax.tree.map(abs64, tree)))
    _compare(got, want, ref_abs)
    flex = [c for c in report if c.runner == "flexlink"]
    assert any(c.operands == 3 for c in flex), str(report)  # one call for the three leaves


def test_grad_through_psum():
    m_ = _mesh(DEVICES, (8,), ("x",))
    x = make_data("float32", (8, 6), seed=11)
    w = make_data("float32", (6,), seed=12)

    def loss(m):
        def inner(x, w):
            s = m.psum(x * w, "x")
            return jnp.sum(jnp.sin(s))[None]
        f = jax.shard_map(inner, mesh=m_, in_specs=(jax.P("x"), jax.P()), out_specs=jax.P("x"))
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1)))

    with hosts.emulated_hosts(4):
        want = host(loss(lax)(x, w))
        got_fn = loss(flx)
        got = host(got_fn(x, w))
        report = flx.collectives(got_fn, x, w)
    assert any(CROSS in c.reason for c in report), str(report)
    for g, wnt in zip(got, want):
        np.testing.assert_allclose(g, wnt, rtol=2e-5, atol=2e-5)


def test_replacement_mode():
    """Plain jax.lax under replace_collectives(): the same results and the legs in collectives()."""
    m_ = _mesh([0, 4, 1, 5, 2, 6, 3, 7], (8,), ("x",))
    args = _args(m_, 8, "int32", seed=21)
    with hosts.emulated_hosts(2):
        want = host(per_device(_body(lax, "x", 8), m_)(*args))
        with flx.replace_collectives():
            fn = per_device(_body(lax, "x", 8), m_)
            got = host(fn(*args))
            report = flx.collectives(fn, *args)
    assert_tree_equal(got, want)
    _check_legs(report, (2, 4))


def test_environment_setting():
    """FLEXLINK_EMULATED_HOSTS (the run-wide form of emulated_hosts) reaches the lowering."""
    code = """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    import jax_flexlink as flx
    m = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x"), mesh=m, in_specs=jax.P("x"),
                              out_specs=jax.P()))
    x = np.arange(64, dtype=np.int32)
    assert (np.asarray(f(x)) == x.reshape(8, 8).sum(0)).all()
    print([(c.runner, c.kind, c.group_size) for c in flx.collectives(f, x)])
    """
    env = dict(os.environ, FLEXLINK_EMULATED_HOSTS="4", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("[('flexlink', 'reduce_scatter', 2), ('xla', 'all_reduce', 4), "
            "('flexlink', 'all_gather', 2)]") in res.stdout, res.stdout
    env["FLEXLINK_EMULATED_HOSTS"] = "3"  # 8 devices do not split into 3 hosts
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode != 0 and "do not split evenly" in res.stderr, res.stderr[-3000:]


# --- what stays lax's ---------------------------------------------------------------------------

_MOVES = {
    "ppermute": lambda m: lambda v: m.ppermute(v, "x", [(i, (i + 1) % 8) for i in range(8)]),
    "all_to_all": lambda m: lambda v: m.all_to_all(v, "x", 0, 0, tiled=True),
}


@pytest.mark.parametrize("kind", sorted(_MOVES))
def test_moves_across_hosts_fall_back(kind):
    m_ = _mesh(DEVICES, (8,), ("x",))
    x = make_data("int32", (8, 8, 2), seed=31)
    with hosts.emulated_hosts(2):
        want = host(per_device(_MOVES[kind](lax), m_)(x))
        with pytest.raises(NotImplementedError, match=f"{kind} over axes .* spans hosts"):
            per_device(_MOVES[kind](flx), m_)(x)
        with flx.replace_collectives():
            fn = per_device(_MOVES[kind](lax), m_)
            got = host(fn(x))
            report = flx.collectives(fn, x)
    assert_tree_equal(got, want)
    assert [c.kind for c in report] == [kind] and report[0].runner == "xla", str(report)
    assert "spans hosts" in report[0].reason and "lax's collective" in report[0].reason


def test_ppermute_inside_a_host_stays_flexlink():
    m_ = _mesh(DEVICES, (2, 4), ("h", "x"))  # 'x' inside each of the 2 hosts
    x = make_data("int32", (2, 4, 3), seed=32)

    def body(m):
        return lambda v: m.ppermute(v, "x", [(i, (i + 1) % 4) for i in range(4)])

    with hosts.emulated_hosts(2):
        want = host(per_device(body(lax), m_)(x))
        fn = per_device(body(flx), m_)
        got = host(fn(x))
        report = flx.collectives(fn, x)
    assert_tree_equal(got, want)
    assert [(c.kind, c.runner) for c in report] == [("ppermute", "flexlink")], str(report)


@pytest.mark.parametrize("order,why", [
    # row 0 has 3 devices on host 0 and 1 on host 1
    ([0, 1, 2, 4, 3, 5, 6, 7], "different numbers of its devices"),
    # rows sit on the hosts in different patterns: (0,1,0,1) and (0,0,1,1)
    ([0, 4, 1, 5, 2, 3, 6, 7], "different patterns"),
])
def test_irregular_layouts_fall_back(order, why):
    m_ = _mesh(order, (2, 4), ("r", "x"))
    x = make_data("int32", (2, 4, 8), seed=41)

    def body(m):
        return lambda v: (m.psum(v, "x"), m.all_gather(v, "x"))

    with hosts.emulated_hosts(2):
        want = host(per_device(body(lax), m_)(x))
        with pytest.raises(NotImplementedError, match=why):
            per_device(body(flx), m_)(x)
        with flx.replace_collectives():
            fn = per_device(body(lax), m_)
            got = host(fn(x))
            report = flx.collectives(fn, x)
    assert_tree_equal(got, want)
    assert report and all(c.runner == "xla" and why in c.reason for c in report), str(report)


def test_one_host_is_flat():
    """Without emulation the 8 devices are one host: the plain FlexLink call, no legs."""
    m_ = _mesh(DEVICES, (8,), ("x",))
    x = make_data("int32", (8, 4), seed=51)
    fn = per_device(lambda v: flx.psum(v, "x"), m_)
    report = flx.collectives(fn, x)
    assert [(c.kind, c.runner, c.group_size) for c in report] == [("all_reduce", "flexlink", 8)]


# --- two processes, one host each ---------------------------------------------------------------

_WORKER = r"""
import os, sys
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["FLEXLINK_HOST_ID"] = f"test-host-{rank}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                           initialization_timeout=120)
import numpy as np
from jax import lax
import jax_flexlink as flx

assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
spec = jax.P("x")
data = {"a": np.arange(8 * 3 * 5, dtype=np.int32).reshape(8, 3, 5) * 40503,
        "b": ((np.arange(8 * 16 * 3, dtype=np.float32) % 13) - 6).reshape(8 * 16, 3)}
glob = {k: jax.make_array_from_callback(v.shape, jax.sharding.NamedSharding(mesh, spec),
                                        lambda idx, v=v: v[idx]) for k, v in data.items()}

def body(m):
    def f(t):
        a, b = t["a"][0], t["b"]
        return (m.psum(a, "x")[None], m.all_gather(a, "x")[None],
                m.psum_scatter(b, "x", tiled=True), m.psum(b, "x")[None])
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))

want, got = body(lax)(glob), body(flx)(glob)
for w, g in zip(want, got):
    for ws, gs in zip(w.addressable_shards, g.addressable_shards):
        assert ws.index == gs.index
        np.testing.assert_array_equal(np.asarray(gs.data), np.asarray(ws.data))
report = flx.collectives(body(flx), glob)
cross = [c for c in report if c.runner == "xla"]
assert len(cross) == 4 and all("cross-host leg" in c.reason and c.group_size == 2 for c in cross), report
assert all(c.group_size == 4 for c in report if c.runner == "flexlink"), report
print("RANK", rank, "OK", flush=True)
jax.distributed.shutdown()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_host_each(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "FLEXLINK_HOST_ID", "FLEXLINK_EMULATED_HOSTS")}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:  # never leave a worker behind, whatever failed
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RANK {r} OK" in out, out[-4000:]
