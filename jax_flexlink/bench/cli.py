"""Command line of `python -m jax_flexlink.bench` (flags after nccl-tests).

Arguments are parsed *before* jax is imported, because --devices must reach XLA_FLAGS first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys

from . import collectives, multiprocess, scenarios, sizes, timing

DEFAULTS = {"warmup_iters": 2, "minbytes": "4K", "maxbytes": "64M", "stepfactor": None, "stepbytes": None,
            "op": "sum", "datatype": "float", "collective": "all_reduce,all_gather"}


@dataclasses.dataclass
class Config:
    sizes: list[int]
    collectives: list[str]
    ops: list[str]
    dtypes: list[str]
    iters: int | None          # None: auto, scaled with the size (timing.auto_iters)
    warmup: int
    check: bool
    devices: int               # 0: every device of the platform (the gpu scenario's default)
    links: str | None
    modes: list[bool]          # inplace flags, out-of-place first (as nccl-tests prints)
    baseline: str
    json_path: str | None
    plot_path: str | None
    scenario: str
    seed: int
    impl: str                  # "flexlink"; "lax" only for the harness's own tests
    argv: list[str]
    settings: dict
    stat: str = "median"       # the time a table shows and speedups use: "median" or "mean"
    platform: str = "cpu"      # "cpu" (host devices) or "gpu" (jax.devices("gpu")), from the scenario
    mp_configs: list = dataclasses.field(default_factory=list)  # --scenario multiprocess: its launches
    mp_timeout: float | None = None   # --scenario multiprocess: the launcher's deadline per configuration
    mp_keep_freed_memory: bool = True  # --scenario multiprocess: the launcher's --keep-freed-memory
    mp_launches: int = 1              # --scenario multiprocess: launches of each configuration
    runs: int = 1              # timed calls of one side in a row (timing.time_interleaved)
    turn_pause_ms: float = 0.0  # with runs > 1: the pause before each turn


def _size_arg(text: str) -> int:
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(low: int):
    def parse(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}: {text}")
        return v
    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


_nonneg_int = _int_at_least(0)
_pos_int = _int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_flexlink.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "nccl-tests style benchmark of jax_flexlink collectives against jax.lax's, inside\n"
            "jax.shard_map over a 1-D mesh of host devices. Sizes are bytes per device as in nccl-tests:\n"
            "AllReduce, SendRecv (ppermute), AlltoAll: the buffer; AllGather: the gathered output;\n"
            "ReduceScatter: the input.\n"
            "Every row checks the result against an exactly known expected output (#wrong); any wrong\n"
            "element makes the exit status 1. Without arguments: AllReduce and AllGather, float32 sum,\n"
            "8 host devices, 4K..64M, FlexLink vs native, in-place and out-of-place."),
        epilog="scenarios:\n" + scenarios.describe() + "\n\nexit status: 0 all correct, 1 wrong "
               "elements, 2 usage or setup error.")
    g = p.add_argument_group("sizes (K/M/G suffixes, binary: 4K = 4096)")
    g.add_argument("-b", "--minbytes", type=_size_arg, help="smallest size (default 4K)")
    g.add_argument("-e", "--maxbytes", type=_size_arg, help="largest size (default 64M)")
    g.add_argument("-f", "--stepfactor", type=float,
                   help="multiply the size by this between rows (default 2 unless -i is given)")
    g.add_argument("-i", "--stepbytes", type=_size_arg,
                   help="add this many bytes between rows instead (used when -f is not > 1)")
    g = p.add_argument_group("what to run")
    g.add_argument("-C", "--collective",
                   help="all_reduce, all_gather, reduce_scatter, ppermute (SendRecv: a ring shift by +1), "
                        "all_to_all, a comma list, or all (default all_reduce,all_gather)")
    g.add_argument("-o", "--op", help="reduction: sum, prod, max, min, a comma list, or all (default sum); "
                                      "AllGather, SendRecv and AlltoAll have none")
    g.add_argument("-d", "--datatype",
                   help="float (float32), half, bfloat16, double, int8, uint8, int16, uint16, int32, "
                        "uint32, int64, uint64, a comma list, or all (default float)")
    g.add_argument("--scenario", default=scenarios.DEFAULT_SCENARIO, help="named setup, see below "
                   f"(default {scenarios.DEFAULT_SCENARIO})")
    g.add_argument("--devices", type=int, help="number of host devices; sets XLA_FLAGS "
                   "--xla_force_host_platform_device_count before jax starts (default: the scenario's, 8); "
                   "with --scenario gpu: the first N GPUs (default all)")
    g.add_argument("--links", help="link spec in FLEXLINK_LINKS syntax, e.g. 'shm;tcp'; passed to "
                   "jax_flexlink.configure(links=...) (default: the scenario's, else the library default)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--inplace", dest="mode", action="store_const", const="inplace",
                      help="only in-place: the input is donated (jit donate_argnums=0), output may alias it")
    mode.add_argument("--outofplace", dest="mode", action="store_const", const="outofplace",
                      help="only out-of-place: a fresh output buffer each call")
    mode.add_argument("--both", dest="mode", action="store_const", const="both",
                      help="both, side by side (default)")
    g.add_argument("--baseline", choices=["native", "none"], default="native",
                   help="compare with the same jax.lax collective in the same run (default), or not")
    g.add_argument("--mp-configs", metavar="LIST",
                   help="--scenario multiprocess: its launches, PxK (P processes x K host devices) or "
                        "HhxPxK (H emulated hosts x P processes x K devices), comma separated "
                        f"(default {multiprocess.DEFAULT_CONFIGS})")
    g.add_argument("--mp-timeout", type=float, metavar="S",
                   help="--scenario multiprocess: the launcher's deadline per configuration, in seconds "
                        f"(default {multiprocess.DEFAULT_TIMEOUT_S:g})")
    g.add_argument("--mp-keep-freed-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="--scenario multiprocess: the launcher's glibc malloc settings that keep freed memory "
                        "for reuse, for FlexLink and the native collective alike (default on; "
                        "--no-mp-keep-freed-memory runs with glibc's defaults; docs/launch.md)")
    g.add_argument("--mp-launches", type=int, metavar="K",
                   help="--scenario multiprocess: launch each configuration K times, the configurations "
                        "taking turns, and end with every point's speedup per launch and its min / median / "
                        "max over the launches (default 1; a launch's speed varies on a shared machine)")
    g = p.add_argument_group("timing and checking")
    g.add_argument("-n", "--iters", type=_nonneg_int, default=0,
                   help=f"timed iterations per size; 0 = auto: ~{timing.AUTO_BYTES_BUDGET >> 20} MiB per "
                        f"rank, clamped to [{timing.AUTO_MIN_ITERS}, {timing.AUTO_MAX_ITERS}] (default 0)")
    g.add_argument("-w", "--warmup_iters", type=_nonneg_int, default=None,
                   help="untimed iterations first (the first also compiles) (default 2)")
    g.add_argument("--runs", type=_pos_int, default=1, metavar="R",
                   help="1 (default): FlexLink and native alternate call by call; R > 1: in turns of one "
                        "untimed call and R timed calls of one side in a row, so that each side is timed "
                        "in a steady state of its own (what the other side leaves behind falls on the "
                        "untimed call); see docs/bench.md")
    g.add_argument("--turn-pause-ms", type=float, default=None, metavar="MS",
                   help=f"with --runs > 1: a pause before each turn, so that what the other side left "
                        f"running (threads still busy) has ended before the next side's turn (default "
                        f"{timing.DEFAULT_TURN_PAUSE_MS:g}; 0: none); see docs/bench.md")
    g.add_argument("--stat", choices=list(timing.STATS), default="median",
                   help="time per row: median (default; robust to single stalled calls on a shared "
                        "machine) or mean (nccl-tests' average); the table shows the speedup by the other "
                        "one too, the JSON has both")
    g.add_argument("-c", "--check", type=int, choices=[0, 1], default=1,
                   help="check every row's result against the exact expected output (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every row (with min/max times) and the setup as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (needs matplotlib)")
    p.add_argument("--_impl", dest="impl", default="flexlink", choices=["flexlink", "lax"],
                   help=argparse.SUPPRESS)  # 'lax': jax.lax stands in for FlexLink (harness self-test)
    return p


def parse(argv: list[str] | None = None) -> Config:
    """Parses and resolves flags (scenario defaults, sizes, lists); exits 2 on bad usage."""
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    try:
        scen = scenarios.get(a.scenario)
    except ValueError as e:
        p.error(str(e))
    if scen.unavailable:
        p.error(scen.unavailable)
    d = dict(DEFAULTS, **scen.defaults)

    def pick(name):
        v = getattr(a, name)
        if v is not None:
            return v
        dv = d.get(name)
        return sizes.parse_size(dv) if name in ("minbytes", "maxbytes", "stepbytes") and dv is not None else dv

    minb, maxb = pick("minbytes"), pick("maxbytes")
    stepf, stepb = pick("stepfactor"), pick("stepbytes")
    if a.stepbytes is not None and a.stepfactor is None:
        stepf = None  # -i alone means additive steps, even if the scenario had a factor
    try:
        sweep = sizes.size_sweep(minb, maxb, stepf, stepb)
        colls = collectives.parse_collectives(pick("collective"))
        ops = collectives.parse_ops(pick("op"))
        dtypes = collectives.parse_dtypes(pick("datatype"))
    except ValueError as e:
        p.error(str(e))
    if not colls or not ops or not dtypes:
        p.error("nothing to run: empty --collective, --op or --datatype")
    if a.devices is not None and a.devices < 1:
        p.error("--devices must be >= 1")
    devices = a.devices if a.devices is not None else (scen.devices or 0)
    mp_configs, mp_timeout, mp_keep, mp_launches = _multiprocess_flags(p, a, scen)
    if a.turn_pause_ms is not None and a.runs == 1:
        p.error("--turn-pause-ms applies only with --runs > 1 (call by call, there are no turns)")
    if a.turn_pause_ms is not None and not 0 <= a.turn_pause_ms <= 1000:
        p.error(f"--turn-pause-ms must be from 0 to 1000, got {a.turn_pause_ms:g}")
    turn_pause_ms = 0.0 if a.runs == 1 else (timing.DEFAULT_TURN_PAUSE_MS if a.turn_pause_ms is None
                                              else a.turn_pause_ms)
    if a.plot:
        from . import report
        try:
            report.check_plot_available()
        except RuntimeError as e:
            p.error(str(e))
    modes = {"inplace": [True], "outofplace": [False]}.get(a.mode or d.get("mode") or "both", [False, True])
    links = a.links if a.links is not None else scen.links
    settings = {"minbytes": minb, "maxbytes": maxb, "stepfactor": stepf, "stepbytes": stepb,
                "iters": a.iters or "auto", "runs": a.runs, "turn_pause_ms": turn_pause_ms, "stat": a.stat, "warmup": pick("warmup_iters"), "check": a.check, "seed": a.seed,
                "collectives": colls, "ops": ops, "dtypes": dtypes,
                "modes": ["inplace" if m else "outofplace" for m in modes]}
    return Config(sizes=sweep, collectives=colls, ops=ops, dtypes=dtypes, iters=a.iters or None,
                  warmup=pick("warmup_iters"), check=bool(a.check), devices=devices, links=links, modes=modes,
                  baseline=a.baseline, json_path=a.json, plot_path=a.plot, scenario=scen.name,
                  seed=a.seed, impl=a.impl, argv=argv, settings=settings, stat=a.stat,
                  platform=scen.platform, mp_configs=mp_configs, mp_timeout=mp_timeout,
                  mp_keep_freed_memory=mp_keep, mp_launches=mp_launches, runs=a.runs,
                  turn_pause_ms=turn_pause_ms)


def _multiprocess_flags(p: argparse.ArgumentParser, a: argparse.Namespace,
                        scen) -> tuple[list, float | None, bool, int]:
    """--mp-configs, --mp-timeout, --mp-keep-freed-memory and --mp-launches belong to --scenario
    multiprocess, whose device counts and launches they give."""
    if scen.name != "multiprocess":
        for flag, v in (("--mp-configs", a.mp_configs), ("--mp-timeout", a.mp_timeout),
                        ("--mp-keep-freed-memory", a.mp_keep_freed_memory), ("--mp-launches", a.mp_launches)):
            if v is not None:
                p.error(f"{flag} applies only to --scenario multiprocess")
        return [], None, True, 1
    if a.devices is not None:
        p.error("--devices does not apply to --scenario multiprocess; its --mp-configs give the processes and "
                "devices (e.g. --mp-configs 2x2: 2 processes x 2 devices)")
    if a.plot:
        p.error("--plot is not supported with --scenario multiprocess (use --json)")
    try:
        configs = multiprocess.parse_configs(a.mp_configs or multiprocess.DEFAULT_CONFIGS)
    except ValueError as e:
        p.error(str(e))
    timeout = multiprocess.DEFAULT_TIMEOUT_S if a.mp_timeout is None else a.mp_timeout
    if not 0 < timeout < float("inf"):  # a deadline must be one (also refuses nan)
        p.error(f"--mp-timeout must be > 0 and finite, got {a.mp_timeout}")
    launches = 1 if a.mp_launches is None else a.mp_launches
    if launches < 1:
        p.error(f"--mp-launches must be >= 1, got {a.mp_launches}")
    return configs, timeout, a.mp_keep_freed_memory is not False, launches


_DEVCOUNT_RE = re.compile(r"--xla_force_host_platform_device_count=\S*")


def set_device_count(n: int, environ=os.environ) -> None:
    """Puts --xla_force_host_platform_device_count=n into XLA_FLAGS (replacing any earlier value)."""
    flags = _DEVCOUNT_RE.sub("", environ.get("XLA_FLAGS", "")).split()
    environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def command_line(argv: list[str]) -> str:
    return shlex.join(["python", "-m", "jax_flexlink.bench", *argv])


_REEXEC_ENV = "JAX_FLEXLINK_BENCH_REEXEC"


def _backends_initialized() -> bool:
    try:
        from jax_flexlink._src import compat
        return compat.backends_initialized()
    except Exception:  # unknown: assume the worst
        return True


def ensure_device_count(n: int, may_restart: bool) -> None:
    """Makes XLA's CPU client start with n host devices.

    XLA reads the flag when the CPU backend is created. `python -m jax_flexlink.bench` first imports the
    jax_flexlink package, which imports jax; if that already created the backend with another device
    count, the process re-executes itself once with the flag in its environment (only when running
    from the command line; a caller of main(argv) must set XLA_FLAGS itself).
    """
    want = f"--xla_force_host_platform_device_count={n}"
    already = want in os.environ.get("XLA_FLAGS", "").split()
    if already:
        return
    if "jax" not in sys.modules or not _backends_initialized():
        set_device_count(n)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return
    if may_restart and not os.environ.get(_REEXEC_ENV):
        set_device_count(n)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ[_REEXEC_ENV] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    if cfg.scenario == "multiprocess":  # one launch per configuration; this process starts no backend
        return multiprocess.run(cfg)
    if cfg.platform == "cpu":  # GPUs are what the machine has; XLA_FLAGS counts host devices only
        ensure_device_count(cfg.devices, may_restart=argv is None)
    from . import runner  # imports jax, now that XLA_FLAGS is final
    return runner.run(cfg)
