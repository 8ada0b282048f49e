"""Bad input to every public entry point: a clear error (the exception type and the words JAX would
use, naming the argument, its value and what is allowed), or, for an environment default read at
import, the default with a warning naming the variable; a tuning cache that cannot be trusted
(truncated, corrupt, another machine's or version's, not a file, huge) never fails a job and is never
used. The inventory these tables follow is docs/errors.md, "Bad input"; the explicit collectives'
argument checks against lax are tests/test_errors.py, the C++ cache parser's cases plan_test's
cache_bad_input."""
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flexlink as flx
from jax_flexlink import _flexlink, launch
from jax_flexlink._src import config, native, runtime
from helpers import N, run_python

# -- the Python API ---------------------------------------------------------------------------------

API = {
    # configure(): each argument's type and range; nothing changes when any is bad
    "timeout_s=0": (lambda: flx.configure(timeout_s=0), ValueError, "timeout_s must be a number of seconds in (0, 1e+06], got 0"),
    "timeout_s=-1": (lambda: flx.configure(timeout_s=-1), ValueError, "got -1"),
    "timeout_s=nan": (lambda: flx.configure(timeout_s=float("nan")), ValueError, "got nan"),
    "timeout_s=inf": (lambda: flx.configure(timeout_s=float("inf")), ValueError, "got inf"),
    "timeout_s=huge": (lambda: flx.configure(timeout_s=1e300), ValueError, "(0, 1e+06]"),
    "timeout_s='5'": (lambda: flx.configure(timeout_s="5"), TypeError, "timeout_s must be a number of seconds, got '5' of type str"),
    "timeout_s=True": (lambda: flx.configure(timeout_s=True), TypeError, "of type bool"),
    "autotune_min_bytes=-1": (lambda: flx.configure(autotune_min_bytes=-1), ValueError, "autotune_min_bytes=-1: expected a byte count"),
    "autotune_min_bytes='1.5M'": (lambda: flx.configure(autotune_min_bytes="1.5M"), ValueError, "autotune_min_bytes='1.5M'"),
    "autotune_min_bytes='1e6'": (lambda: flx.configure(autotune_min_bytes="1e6"), ValueError, "'1e6'"),
    "autotune_min_bytes=fullwidth": (lambda: flx.configure(autotune_min_bytes="\uff11M"), ValueError, "expected a byte count"),
    "autotune_min_bytes=2**70": (lambda: flx.configure(autotune_min_bytes=2 ** 70), ValueError, "0 to 2**63"),
    "autotune_min_bytes=1.5": (lambda: flx.configure(autotune_min_bytes=1.5), TypeError, "got 1.5 of type float"),
    "autotune_min_bytes=True": (lambda: flx.configure(autotune_min_bytes=True), TypeError, "of type bool"),
    "tune_max_bytes=64K": (lambda: flx.configure(tune_max_bytes="64K"), ValueError, "must be at least 128K"),
    "links=5": (lambda: flx.configure(links=5), TypeError, "links must be a string such as 'shm;tcp'"),
    "links=['shm']": (lambda: flx.configure(links=["shm"]), TypeError, "of type list"),
    "links=''": (lambda: flx.configure(links=""), ValueError, "link spec is empty"),
    "links=NUL": (lambda: flx.configure(links="shm;tcp\x00"), ValueError, "no control characters"),
    "links unknown kind": (lambda: flx.configure(links="shm;tpc"), ValueError, 'unknown link kind "tpc" (known: shm, tcp, emulated)'),
    "links duplicate": (lambda: flx.configure(links="shm;shm"), ValueError, 'duplicate link name "shm"'),
    "links trailing ;": (lambda: flx.configure(links="shm;"), ValueError, "part 2 is empty"),
    "links unicode": (lambda: flx.configure(links="\uff53hm"), ValueError, "bad link kind"),
    "links gbps=nan": (lambda: flx.configure(links="emulated@gbps=nan"), ValueError, 'gbps="nan" is not a number'),
    "links gbps=0": (lambda: flx.configure(links="emulated@gbps=0"), ValueError, "out of range"),
    "links param typo": (lambda: flx.configure(links="emulated@gpbs=1"), ValueError, 'unknown parameter "gpbs"'),
    "links param twice": (lambda: flx.configure(links="emulated@gbps=1,gbps=2"), ValueError, "given twice"),
    "links GPU on CPU build": (lambda: flx.configure(links="shm;nccl"), ValueError, "mix GPU links"),
    "configure positional": (lambda: flx.configure("shm"), TypeError, "positional"),
    "configure unknown": (lambda: flx.configure(link="shm"), TypeError, "unexpected keyword argument 'link'"),
    # tune()
    "tune unknown collective": (lambda: flx.tune(collectives=("bogus",)), ValueError, "unknown collective 'bogus'; stage 1 profiles all_reduce"),
    "tune ppermute": (lambda: flx.tune(collectives=("ppermute",)), ValueError, "unknown collective 'ppermute'"),
    "tune no collectives": (lambda: flx.tune(collectives=()), ValueError, "collectives is empty"),
    "tune collectives=5": (lambda: flx.tune(collectives=5), TypeError, "a name or a sequence of names"),
    "tune devices=[]": (lambda: flx.tune(devices=[]), ValueError, "devices is empty"),
    "tune devices ids": (lambda: flx.tune(devices=[0, 1]), TypeError, "devices must be jax devices"),
    "tune devices twice": (lambda: flx.tune(devices=jax.devices()[:1] * 2), ValueError, "name a device twice"),
    "tune max_bytes=0": (lambda: flx.tune(max_bytes=0), ValueError, "max_bytes=0: must be at least 128K"),
    "tune use_cache='no'": (lambda: flx.tune(use_cache="no"), TypeError, "use_cache must be True or False, got 'no'"),
    # replacement mode and its JAX option: "no" must not mean True
    "replace_collectives('no')": (lambda: flx.replace_collectives("no"), TypeError, "replace_collectives(enabled) must be True or False"),
    "replace_collectives(2)": (lambda: flx.replace_collectives(2), TypeError, "got 2 of type int"),
    "jax option 'yes'": (lambda: jax.config.update("jax_flexlink_replace_collectives", "yes"), TypeError,
                         "jax_flexlink_replace_collectives must be True or False, got 'yes'"),
    # the rest take no arguments, or a function
    "stats(1)": (lambda: flx.stats(1), TypeError, "positional"),
    "reset_stats(1)": (lambda: flx.reset_stats(1), TypeError, "positional"),
    "links(1)": (lambda: flx.links(1), TypeError, "positional"),
    "collectives('x')": (lambda: flx.collectives("x"), TypeError, "Expected a callable value, got 'x'"),
    "collectives(1)": (lambda: flx.collectives(1), TypeError, "Expected a callable value"),
}


@pytest.fixture
def shm_and_emulated():
    flx.configure(links="shm;emulated:e@gbps=50")
    yield
    flx.configure(links="shm")


@pytest.mark.parametrize("case", list(API))
def test_api_rejects_bad_arguments(case, shm_and_emulated):
    thunk, exc_type, fragment = API[case]
    before = (flx.links(), _flexlink.timeout(), _flexlink.autotune_min_bytes(), _flexlink.tune_max_bytes(),
              flx.replacing_collectives())
    with pytest.raises(exc_type) as e:
        thunk()
    assert fragment in str(e.value), f"{type(e.value).__name__}: {e.value}"
    after = (flx.links(), _flexlink.timeout(), _flexlink.autotune_min_bytes(), _flexlink.tune_max_bytes(),
             flx.replacing_collectives())
    assert after == before, "a rejected call changed the configuration"


def test_configure_checks_every_argument_before_changing_any():
    timeout = _flexlink.timeout()
    with pytest.raises(ValueError, match="autotune_min_bytes"):
        flx.configure(timeout_s=7, autotune_min_bytes="lots")
    with pytest.raises(ValueError, match="tpc"):
        flx.configure(timeout_s=7, links="shm;tpc")
    assert _flexlink.timeout() == timeout and flx.links() == ["shm"]


def test_api_accepts_the_edges_of_what_is_allowed():
    """The positive controls: the bounds themselves and the spellings the docs promise."""
    saved = (_flexlink.timeout(), _flexlink.autotune_min_bytes(), _flexlink.tune_max_bytes())
    try:
        flx.configure(timeout_s=1e6)
        assert _flexlink.timeout() == 1e6
        flx.configure(timeout_s=np.float32(2.5), autotune_min_bytes=" 64 kib ", tune_max_bytes="128K")
        assert (_flexlink.timeout(), _flexlink.autotune_min_bytes(), _flexlink.tune_max_bytes()) == (2.5, 64 << 10, 128 << 10)
        flx.configure(autotune_min_bytes=np.int64(0), links=" shm ; tcp ")
        assert _flexlink.autotune_min_bytes() == 0 and flx.links() == ["shm", "tcp"]
        with flx.replace_collectives(np.bool_(True)):
            assert flx.replacing_collectives()
        assert not flx.replacing_collectives()
    finally:
        flx.configure(links="shm", timeout_s=saved[0], autotune_min_bytes=saved[1], tune_max_bytes=saved[2])


def test_engine_refuses_a_deadline_that_is_not_one():
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e7):
        with pytest.raises(ValueError, match=r"set_timeout: seconds must be a finite number in \(0, 1e6\]"):
            _flexlink.set_timeout(bad)


def test_psum_scatter_negative_dimension_as_lax(mesh1d):
    """jax 0.10's lax passes a negative scatter_dimension to its lowering, whose verifier rejects it
    (ValueError); FlexLink then says so at lowering too, instead of failing the first run in the
    engine. jax 0.11 normalises it first: then both give the same result."""
    from jax import lax

    def build(m):
        return jax.jit(jax.shard_map(lambda v: m.psum_scatter(v, "x", scatter_dimension=-1, tiled=True),
                                     mesh=mesh1d, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    x = jnp.arange(N * N * 2, dtype=jnp.float32).reshape(N, 2 * N)
    try:
        want = np.asarray(build(lax)(x))
    except ValueError:
        with pytest.raises(ValueError, match=r"scatter_dimension=-1 must be in \[0, 2\)"):
            build(flx).lower(x)
    else:
        np.testing.assert_array_equal(np.asarray(build(flx)(x)), want)


LAUNCH_ENV = {
    "not integers": ({"FLEXLINK_NUM_PROCESSES": "two", "FLEXLINK_PROCESS_ID": "0"}, "must be integers"),
    "rank past n": ({"FLEXLINK_NUM_PROCESSES": "2", "FLEXLINK_PROCESS_ID": "2"}, "0 <= FLEXLINK_PROCESS_ID < FLEXLINK_NUM_PROCESSES"),
    "negative rank": ({"FLEXLINK_NUM_PROCESSES": "2", "FLEXLINK_PROCESS_ID": "-1"}, "'-1'"),
    "zero processes": ({"FLEXLINK_NUM_PROCESSES": "0", "FLEXLINK_PROCESS_ID": "0"}, "'0'"),
    "coordinator": ({"FLEXLINK_COORDINATOR": "localhost"}, "FLEXLINK_COORDINATOR must be HOST:PORT, got 'localhost'"),
}


@pytest.mark.parametrize("case", list(LAUNCH_ENV))
def test_launch_initialize_rejects_bad_variables(case, monkeypatch):
    env, fragment = LAUNCH_ENV[case]
    base = {"FLEXLINK_COORDINATOR": "127.0.0.1:1234", "FLEXLINK_NUM_PROCESSES": "2", "FLEXLINK_PROCESS_ID": "0"}
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError) as e:  # before jax.distributed is touched
        launch.initialize()
    assert fragment in str(e.value), str(e.value)


# -- byte counts: Python's reader and the engine's agree ------------------------------------------

BYTE_TEXTS = ["4194304", "4M", " 64k ", "1GiB", "2 MB", "0", "", " ", "-1", "+5", "4.5M", "1e6", "4MiBs", "M",
              "0x10", "4 4M", "1_000", "\uff11M", "\u0661", "99999999999999999999", "9999999999G",
              str(1 << 63), str((1 << 63) + 1), "8589934592G", "8589934593G", "4\tK", "\x0b4M"]


@pytest.mark.parametrize("text", BYTE_TEXTS, ids=repr)
def test_byte_counts_read_alike_in_python_and_the_engine(text):
    try:
        mine = config.parse_bytes(text, "X")
    except ValueError:
        mine = None
    assert mine == _flexlink.parse_byte_count(text), (mine, _flexlink.parse_byte_count(text))


# -- environment variables (read at import: the default, with a warning) --------------------------

ENV_PROBE = """
    import json, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import jax_flexlink as flx
        from jax_flexlink._src import native
        from jax_flexlink._src.config import ENV
    print("RESULT", json.dumps({
        "warnings": [str(w.message) for w in caught if "jax_flexlink" in str(w.message)],
        "env": {k: v for k, v in vars(ENV).items()}, "links": flx.links(),
        "timeout": flx._flexlink.timeout(), "autotune": flx._flexlink.autotune_min_bytes(),
        "tune_max": flx._flexlink.tune_max_bytes(), "replacing": flx.replacing_collectives(),
        "config_warnings": flx._flexlink.config_warnings(),
        "gpu_links": None if native.cuda_module() is None else native.cuda_module().links()}))
"""

DEFAULTS = {"timeout_s": 300.0, "autotune_min_bytes": 1 << 20, "tune_max_bytes": 16 << 20,
            "combine_bytes": 64 << 20, "debug_level": 0, "replace_collectives": False, "links": "shm",
            "emulated_hosts": 1}

# Two batches of bad values, every variable in each (one import each); the fragment each warning has.
BAD_ENV = [
    {"FLEXLINK_TIMEOUT_S": ("inf", "a number of seconds in (0, 1e+06]; using the default 300"),
     "FLEXLINK_AUTOTUNE_MIN_BYTES": ("1e6", "expected a byte count such as 1048576, 64K or 1M; using the default 1M"),
     "FLEXLINK_TUNE_MAX_BYTES": ("64K", "at least 128K such as 16M; using the default 16M"),
     "FLEXLINK_COMBINE_BYTES": ("-1", "using the default 64M"),
     "FLEXLINK_XPROC_SLOT_BYTES": ("-1", "positive byte count such as 1048576, 256K or 4M; using the defaults (1M for CPU groups, 4M for GPU groups' pcie staging)"),
     "FLEXLINK_XPROC_DIRECT_BYTES": ("-1", "a byte count such as 262144, 256K or 1M, or 0/off (never); using the default 64K"),
     "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES": ("1.5M", "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES='1.5M': expected a byte count such as 262144, 256K or 1M, or 0/off (never); using the default off"),
     "FLEXLINK_SPIN_US": ("-5", "expected microseconds from 0 to 10000 such as 50 (0: never spin); using the engine's choice"),
     "FLEXLINK_DEBUG": ("verbose", "expected INFO"),
     "FLEXLINK_REPLACE_COLLECTIVES": ("maybe", "expected one of 1, true, yes, on, 0, false, no, off; using the default false"),
     "FLEXLINK_LINKS": ("shm;bogus", 'unknown link kind "bogus"'),
     "FLEXLINK_EMULATED_HOSTS": ("0", "a number of hosts >= 1; using the default 1"),
     "FLEXLINK_LINK_TIMEOUT_S": ("-2", "a number of seconds in (0, 1e+06]; using the default 10")},
    {"FLEXLINK_TIMEOUT_S": ("\uff11\uff10", "using the default 300"),
     "FLEXLINK_AUTOTUNE_MIN_BYTES": ("99999999999999999999G", "using the default 1M"),
     "FLEXLINK_TUNE_MAX_BYTES": ("lots", "using the default 16M"),
     "FLEXLINK_COMBINE_BYTES": ("1.5M", "using the default 64M"),
     "FLEXLINK_XPROC_SLOT_BYTES": ("0", "using the defaults (1M for CPU groups"),
     "FLEXLINK_XPROC_DIRECT_BYTES": ("never", "using the default 64K"),
     "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES": ("-5", "using the default off"),
     "FLEXLINK_SPIN_US": ("50us", "using the engine's choice"),
     "FLEXLINK_DEBUG": ("\u00e9", "(no logging)"),
     "FLEXLINK_REPLACE_COLLECTIVES": ("2", "using the default false"),
     "FLEXLINK_LINKS": ("nccl;pcie", "no CUDA module"),
     "FLEXLINK_EMULATED_HOSTS": ("two", "using the default 1"),
     "FLEXLINK_LINK_TIMEOUT_S": ("soon", "using the default 10")},
]


def _probe(env):
    res = run_python(ENV_PROBE, env_extra=env)
    assert res.returncode == 0, res.stderr[-3000:]
    line, = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("batch", range(len(BAD_ENV)))
def test_bad_environment_values_warn_and_use_the_default(batch):
    env = {name: value for name, (value, _) in BAD_ENV[batch].items()}
    bad = dict(BAD_ENV[batch])
    if env["FLEXLINK_LINKS"] == "nccl;pcie" and native.cuda_module() is not None:
        # A build with the CUDA module takes GPU links for its GPU engine; the CPU engine keeps shm.
        del bad["FLEXLINK_LINKS"]
    got = _probe(env)
    for name, (value, fragment) in bad.items():
        mine = [w for w in got["warnings"] if f"ignoring {name}={value!r}" in w]
        assert len(mine) == 1 and fragment in mine[0], (name, got["warnings"])
    assert len(got["warnings"]) == len(bad), got["warnings"]
    # The GPU engine's links: its default (nccl) unless the spec was a valid GPU one.
    if native.cuda_module() is None:
        assert got["gpu_links"] is None, got
    else:
        assert got["gpu_links"] == (["nccl"] if "FLEXLINK_LINKS" in bad else ["nccl", "pcie"]), got
    for key, default in DEFAULTS.items():
        assert got["env"][key] == default or key == "links", (key, got["env"])
    assert got["links"] == ["shm"] and got["timeout"] == 300.0 and got["autotune"] == 1 << 20
    assert got["tune_max"] == 16 << 20 and got["replacing"] is False


def test_unusual_but_valid_environment_values_are_taken():
    got = _probe({"FLEXLINK_TIMEOUT_S": " 1e3 ", "FLEXLINK_AUTOTUNE_MIN_BYTES": "64 k", "FLEXLINK_TUNE_MAX_BYTES": "1GiB",
                  "FLEXLINK_COMBINE_BYTES": "0", "FLEXLINK_XPROC_SLOT_BYTES": "256K", "FLEXLINK_XPROC_DIRECT_BYTES": "off", "FLEXLINK_XPROC_DIRECT_REDUCE_BYTES": "2M", "FLEXLINK_SPIN_US": " 20 ", "FLEXLINK_DEBUG": "info",
                  "FLEXLINK_REPLACE_COLLECTIVES": " YES ", "FLEXLINK_LINKS": " shm ; tcp ", "FLEXLINK_EMULATED_HOSTS": "2",
                  "FLEXLINK_HOST_ID": " host-\u00fc 1 "})
    assert got["warnings"] == [] and got["config_warnings"] == [], got
    assert (got["timeout"], got["autotune"], got["tune_max"]) == (1000.0, 64 << 10, 1 << 30), got
    assert got["env"]["combine_bytes"] == 0 and got["env"]["debug_level"] == 1 and got["replacing"] is True
    assert got["links"] == ["shm", "tcp"] and got["env"]["emulated_hosts"] == 2
    assert got["env"]["host_id"] == "host-\u00fc 1", got["env"]


def test_jax_option_environment_variable_is_jax_s_to_check():
    """JAX_FLEXLINK_REPLACE_COLLECTIVES is read by jax's own config, like every JAX_* variable: a bad
    value is jax's ValueError naming it, at import."""
    res = run_python("import jax_flexlink", env_extra={"JAX_FLEXLINK_REPLACE_COLLECTIVES": "maybe"})
    assert res.returncode != 0
    assert "invalid truth value 'maybe' for environment 'JAX_FLEXLINK_REPLACE_COLLECTIVES'" in res.stderr, res.stderr[-2000:]


# -- the tuning cache -----------------------------------------------------------------------------

LINKS = "shm;emulated:e@gbps=50"
# Fits nothing measures on this machine: if they show up in a group's model, they came from the file.
PLANTED = [{"link": "shm", "alpha_s": 1.2345e-3, "beta_s_per_byte": 2.5e-9},
           {"link": "e", "alpha_s": 2.3456e-3, "beta_s_per_byte": 7.5e-9}]


def entry(ranks=N, **changes):
    ident = _flexlink.tune_cache_identity()
    e = {"host": ident["host"], "links": LINKS, "ranks": ranks, "fingerprint": ident["fingerprint"],
         "engine": ident["engine"], "max_bytes": 1 << 20, "link_names": ["shm", "e"],
         "fits": {"all_reduce": [dict(f) for f in PLANTED]}, "split_min_bytes": {"all_reduce": 65536},
         "profiled_bytes": {"all_reduce": 1 << 20}}
    e.update(changes)
    return e


def document(*entries, version=None):
    return {"format": "jax_flexlink tuning cache", "version": version or _flexlink.tune_cache_identity()["version"],
            "entries": list(entries)}


def with_fit(**fit):
    e = entry()
    e["fits"]["all_reduce"][0].update(fit)
    return e


GOOD = json.dumps(document(entry()), indent=2)

CACHE_FILES = {
    # name: (what to put at the path, fragment of the warning)
    "truncated": (GOOD[: len(GOOD) // 2], "corrupt (json:"),
    "empty": ("", "the file is empty"),
    "not JSON": ("\x00\xff not json", "corrupt"),
    "a list": ("[]", "not a JSON object"),
    "no entries": (json.dumps({"version": 2}), 'no "entries" list'),
    "entries not objects": (json.dumps(document(1, "two")), "entry 1 is not an object"),
    "version as text": (json.dumps({**document(entry()), "version": "2"}), 'no numeric "version"'),
    "alpha as text": (json.dumps(document(with_fit(alpha_s="1e-3"))), "without numeric alpha_s"),
    "NaN fit": (json.dumps(document(with_fit(alpha_s=float("nan")))), "corrupt (json: bad value"),
    "infinite fit": (json.dumps(document(with_fit(beta_s_per_byte=float("inf")))), "corrupt (json: bad value"),
    "negative alpha": (json.dumps(document(with_fit(alpha_s=-1e-6))), "alpha_s="),
    "absurd bandwidth": (json.dumps(document(with_fit(beta_s_per_byte=1e-30))), "is not a link's"),
    "zero beta": (json.dumps(document(with_fit(beta_s_per_byte=0))), "beta_s_per_byte=0"),
    "fractional max_bytes": (json.dumps(document(entry(max_bytes=0.5))), "max_bytes"),
    "threshold -7": (json.dumps(document(entry(split_min_bytes={"all_reduce": -7}))), "split_min_bytes"),
    "fits of an unknown collective": (json.dumps(document(entry(fits={"broadcast": PLANTED}))), 'unknown collective "broadcast"'),
    "wrong link names": (json.dumps(document(entry(link_names=["shm", "nvlink"]))), "link_names do not match"),
    "another machine": (json.dumps(document(entry(fingerprint="cpu=Other CPU;cpus=256;mem_gib=2048"))),
                        'measured on another machine (fingerprint "cpu=Other CPU'),
    "no fingerprint": (json.dumps(document({k: v for k, v in entry().items() if k != "fingerprint"})), "no host fingerprint"),
    "another engine revision": (json.dumps(document(entry(engine="flexlink-engine-0"))), 'another engine revision ("flexlink-engine-0"'),
    "processes as text": (json.dumps(document(entry(processes="1"))), '"processes" is not a process count'),
    "more processes than ranks": (json.dumps(document(entry(processes=N + 1))), '"processes" is not a process count'),
    "format version 1": (json.dumps(document(entry(), version=1)), "format version 1 is out of date"),
    "format version 4": (json.dumps(document(entry(), version=4)), "written by a newer jax_flexlink (format version 4"),
}


@pytest.fixture
def cache_file(tmp_path):
    """The engine's and Python's tuning cache pointed at a fresh file; stage 1 in the engine off, so
    a group's model can only come from the cache."""
    path = tmp_path / "tune.json"
    previous = _flexlink.tune_cache_file()
    _flexlink.set_tune_cache_path(str(path))
    flx.configure(links=LINKS, autotune_min_bytes=0)
    yield path
    _flexlink.set_tune_cache_path(previous)
    flx.configure(links="shm", autotune_min_bytes=config.ENV.autotune_min_bytes,
                  tune_max_bytes=config.ENV.tune_max_bytes)


def first_lowering_and_run(devices=None, nbytes=4096):
    """A new program (a fresh lowering, which reads the cache) run once; checks its result."""
    devices = jax.devices() if devices is None else devices
    mesh = Mesh(np.array(devices), ("x",))
    f = jax.jit(jax.shard_map(lambda v: flx.psum(v, "x") * 1, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    x = jax.device_put(jnp.ones((len(devices) * (nbytes // 4),), jnp.float32), NamedSharding(mesh, P("x")))
    assert (np.asarray(f(x)) == len(devices)).all()


def planted_in(devices):
    model = _flexlink.group_fits([d.id for d in devices])
    if model is None or "all_reduce" not in model["fits"]:
        return False
    return [tuple(f) for f in model["fits"]["all_reduce"]] == [(p["alpha_s"], p["beta_s_per_byte"]) for p in PLANTED]


def test_a_valid_cache_entry_is_used(cache_file):
    """The positive control for the table below: the same entry, intact, is what the group plans with."""
    cache_file.write_text(GOOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first_lowering_and_run()
    assert planted_in(jax.devices())


@pytest.mark.parametrize("case", list(CACHE_FILES))
def test_an_untrustworthy_cache_warns_and_is_not_used(case, cache_file):
    text, fragment = CACHE_FILES[case]
    cache_file.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.warns(UserWarning) as caught:
        first_lowering_and_run()
    mine = [str(w.message) for w in caught if str(cache_file) in str(w.message)]
    assert len(mine) == 1 and fragment in mine[0] and mine[0].startswith("jax_flexlink: ignoring"), \
        [str(w.message) for w in caught]
    assert not planted_in(jax.devices()), "the plan came from the bad entry"


def test_a_directory_at_the_cache_path(cache_file):
    cache_file.mkdir()
    with pytest.warns(UserWarning, match="it is a directory, not a file"):
        first_lowering_and_run()
    assert cache_file.is_dir()


def test_a_huge_file_at_the_cache_path_is_refused_unread(cache_file):
    with open(cache_file, "wb") as f:  # sparse: 400 MB that take no disk
        f.truncate(400 << 20)
    with pytest.warns(UserWarning, match=r"it is 419430400 bytes, more than a tuning cache can be \(16 MiB\)"):
        first_lowering_and_run()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its permissions")
def test_an_unreadable_cache(cache_file):
    cache_file.write_text(GOOD)
    cache_file.chmod(0)
    with pytest.warns(UserWarning, match="cannot open it"):
        first_lowering_and_run()
    assert not planted_in(jax.devices())


def test_stage1_in_the_engine_distrusts_a_foreign_entry_and_replaces_it(cache_file, capfd):
    """The engine's own read (a group's first large call; here a group of 4, which the import-time
    read of all 8 devices does not cover): another machine's entry is reported on stderr, whatever
    FLEXLINK_DEBUG says, stage 1 profiles instead, and the store replaces the entry with this
    machine's."""
    devices = jax.devices()[:4]
    foreign = "cpu=Other CPU;cpus=256;mem_gib=2048"
    cache_file.write_text(json.dumps(document(entry(ranks=4, fingerprint=foreign))))
    flx.configure(autotune_min_bytes="64K", tune_max_bytes="128K")
    first_lowering_and_run(devices, nbytes=128 << 10)
    err = capfd.readouterr().err
    assert f"flexlink: warning: ignoring the tuning cache entry for \"{LINKS}\" on 4 ranks in {cache_file}" in err, err
    assert "measured on another machine" in err, err
    assert not planted_in(devices)
    assert "all_reduce" in _flexlink.group_fits([d.id for d in devices])["fits"]
    stored, = json.loads(cache_file.read_text())["entries"]
    assert stored["fingerprint"] == _flexlink.tune_cache_identity()["fingerprint"] and stored["ranks"] == 4


def test_stage1_in_the_engine_uses_a_valid_entry(cache_file, capfd):
    """The positive control of the test above: the same entry made here is taken, not re-profiled."""
    devices = jax.devices()[:4]
    cache_file.write_text(json.dumps(document(entry(ranks=4))))
    flx.configure(autotune_min_bytes="64K", tune_max_bytes="128K")
    first_lowering_and_run(devices, nbytes=128 << 10)
    assert "warning" not in capfd.readouterr().err
    assert planted_in(devices)


def test_cache_writes_are_atomic_and_leave_nothing_behind(cache_file):
    """tune() stores through a temporary file in the same directory, renamed over the target."""
    cache_file.write_text("{ half a file")
    with pytest.warns(UserWarning, match="corrupt"):
        flx.tune(collectives="all_reduce", max_bytes="128K", use_cache=False)
    assert sorted(p.name for p in cache_file.parent.iterdir()) == ["tune.json"]
    doc = json.loads(cache_file.read_text())
    assert doc["version"] == _flexlink.tune_cache_identity()["version"] and len(doc["entries"]) == 1
