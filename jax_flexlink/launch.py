"""`python -m jax_flexlink.launch -n N [...] -- CMD ARGS...`: N local processes of one jax.distributed job.

One machine, loopback only: the launcher picks a free port on 127.0.0.1 for jax's coordinator, starts
N copies of CMD, each in its own process group, with the environment below, prefixes every line they
print with their rank, and makes sure none outlives it (docs/launch.md).

jax takes only the coordinator's address from the environment (JAX_COORDINATOR_ADDRESS, in 0.10 and
0.11); the number of processes and the process id come from cluster auto-detection (Slurm, Open MPI,
...) or from arguments. So a program started here calls `jax_flexlink.launch.initialize()` before any
other jax call, which reads the launcher's variables and calls `jax.distributed.initialize(...)`.

Environment of rank i (of N, K devices each, H emulated hosts):
  FLEXLINK_COORDINATOR=127.0.0.1:PORT  FLEXLINK_NUM_PROCESSES=N  FLEXLINK_PROCESS_ID=i
  FLEXLINK_DEVICES_PER_PROCESS=K  JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT
  JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:PORT (jax's default binds every interface)
  host devices: XLA_FLAGS=... --xla_force_host_platform_device_count=K  JAX_PLATFORMS=cpu (unless set)
  GPUs (--gpus-per-process K): FLEXLINK_LOCAL_DEVICE_IDS=JAX_LOCAL_DEVICE_IDS=iK,...,iK+K-1 (initialize()
    passes them to jax as local_device_ids; a plain jax.distributed.initialize reads the second)
    JAX_PLATFORMS=cuda (unless set; a value not listing cuda or gpu first is a usage error); XLA_FLAGS as inherited
  PYTHONUNBUFFERED=1 (unless set; lines arrive as they are printed)
  GLIBC_TUNABLES gains glibc.malloc.trim_threshold=268435456 and glibc.malloc.mmap_threshold=33554432
    unless the inherited value sets them or --no-keep-freed-memory is given (KEEP_FREED_MEMORY below)
  with --hosts H: FLEXLINK_HOST_ID=host<i // (N/H)>, FLEXLINK_NUM_HOSTS=H (otherwise both removed)

This module imports only the standard library at the top: the launcher itself never starts jax.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

PROG = "python -m jax_flexlink.launch"
DEFAULT_TIMEOUT_S = 600.0
GRACE_S = 3.0           # SIGTERM -> SIGKILL: long enough for Python's exit handlers, short for a test
EXIT_TIMEOUT = 124      # as timeout(1)
_POLL_S = 0.05

# The variables this launcher owns; a value inherited from an outer launch must not leak through.
ENV_VARS = ("FLEXLINK_COORDINATOR", "FLEXLINK_NUM_PROCESSES", "FLEXLINK_PROCESS_ID",
            "FLEXLINK_DEVICES_PER_PROCESS", "FLEXLINK_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS",
            "FLEXLINK_HOST_ID", "FLEXLINK_NUM_HOSTS")

_DEVCOUNT_RE = re.compile(r"--xla_force_host_platform_device_count=\S*")

# glibc's malloc hands freed memory back to the kernel eagerly: a block from 128 KiB up is a mapping
# of its own, unmapped when freed (the threshold then adapts to what was freed), and an arena's free
# top beyond a threshold is trimmed. XLA allocates every collective's output afresh, so in some
# processes its pages are faulted in and zeroed by the kernel at every call (2 processes, 1 MiB
# AllGather: up to 99 faults per call, 124-444 us, against 0-1 and 123-158 us with these settings;
# docs/launch.md). Settings of the whole process, read by glibc at exec: every collective (FlexLink's,
# XLA's own) and every other buffer gains alike; the cost is free memory kept for reuse, up to 256 MiB
# per malloc arena.
KEEP_FREED_MEMORY = (("glibc.malloc.trim_threshold", str(256 << 20)),
                     ("glibc.malloc.mmap_threshold", str(32 << 20)))


# --- the program side -------------------------------------------------------------------------------

def initialize(**kwargs) -> tuple[int, int]:
    """`jax.distributed.initialize(...)` from the launcher's variables; returns (process_id, num_processes).

    Call it first, before anything asks jax for devices. kwargs go to jax.distributed.initialize
    (e.g. initialization_timeout=60). Cluster auto-detection is off: a program started by this launcher
    inside a Slurm or MPI allocation is still this launcher's job. Started with --gpus-per-process,
    the rank's GPUs (FLEXLINK_LOCAL_DEVICE_IDS) go to jax as `local_device_ids` unless kwargs name them.
    """
    env = os.environ
    missing = [v for v in ("FLEXLINK_COORDINATOR", "FLEXLINK_NUM_PROCESSES", "FLEXLINK_PROCESS_ID")
               if not env.get(v)]
    if missing:
        raise RuntimeError(f"jax_flexlink.launch.initialize(): {', '.join(missing)} not set; start the "
                           f"program with `{PROG} -n N -- python script.py`")
    n_text, rank_text = env["FLEXLINK_NUM_PROCESSES"], env["FLEXLINK_PROCESS_ID"]
    if not (re.fullmatch(r"\s*[0-9]+\s*", n_text, re.ASCII) and re.fullmatch(r"\s*[0-9]+\s*", rank_text, re.ASCII)
            and 0 <= int(rank_text) < int(n_text)):
        raise RuntimeError("jax_flexlink.launch.initialize(): FLEXLINK_NUM_PROCESSES and FLEXLINK_PROCESS_ID "
                           "must be integers with 0 <= FLEXLINK_PROCESS_ID < FLEXLINK_NUM_PROCESSES, got "
                           f"{n_text!r} and {rank_text!r}")
    n, rank = int(n_text), int(rank_text)
    if not re.fullmatch(r"[^\s:]+:[0-9]{1,5}", env["FLEXLINK_COORDINATOR"], re.ASCII):
        raise RuntimeError("jax_flexlink.launch.initialize(): FLEXLINK_COORDINATOR must be HOST:PORT, got "
                           f"{env['FLEXLINK_COORDINATOR']!r}")
    ids_text = env.get("FLEXLINK_LOCAL_DEVICE_IDS", "")
    if ids_text:
        if not re.fullmatch(r"[0-9]+(,[0-9]+)*", ids_text, re.ASCII):
            raise RuntimeError("jax_flexlink.launch.initialize(): FLEXLINK_LOCAL_DEVICE_IDS must be GPU numbers "
                               f"separated by commas (e.g. 2,3), got {ids_text!r}")
        kwargs.setdefault("local_device_ids", [int(t) for t in ids_text.split(",")])
    import jax  # noqa: PLC0415 - only the program side needs jax
    kwargs.setdefault("cluster_detection_method", "deactivate")
    try:
        jax.distributed.initialize(env["FLEXLINK_COORDINATOR"], num_processes=n, process_id=rank, **kwargs)
    except RuntimeError as e:
        if "before any JAX calls" in str(e) or "backend" in str(e):
            raise RuntimeError("jax_flexlink.launch.initialize() must run before anything starts jax's "
                               f"backend (jax.devices(), an array, a jitted call): {e}") from e
        raise
    return rank, n


# --- the launcher side ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} -n N [--devices-per-process K | --gpus-per-process K] [--hosts H] [--timeout S] "
              "[--no-keep-freed-memory] -- CMD [ARGS...]",
        description="Starts N processes of one jax.distributed job on this machine (coordinator on a free "
                    "loopback port), prefixes their output with [rank], stops all of them when one fails, "
                    "at the deadline, or when the launcher is interrupted. The program calls "
                    "jax_flexlink.launch.initialize() before any other jax call.",
        epilog="exit status: 0 every rank exited 0; the first failing rank's code (128+N for signal N); "
               "124 deadline; 130/143 interrupted (SIGINT/SIGTERM); 2 usage error.")
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of processes (>= 1)")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                   help="host (CPU) devices per process: XLA_FLAGS --xla_force_host_platform_device_count=K "
                        "(default 1)")
    p.add_argument("--gpus-per-process", type=int, default=None, metavar="K",
                   help="a GPU job instead: process i drives GPUs iK..iK+K-1 (jax's local_device_ids, through "
                        "initialize()), JAX_PLATFORMS=cuda unless set; the machine must show N*K GPUs")
    p.add_argument("--hosts", type=int, default=None, metavar="H",
                   help="emulate H hosts: process i gets FLEXLINK_HOST_ID=host<i // (N/H)> (consecutive "
                        "blocks); H must divide N")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"deadline in seconds for the whole job; past it every rank is stopped and the exit "
                        f"status is {EXIT_TIMEOUT} (default {DEFAULT_TIMEOUT_S:.0f})")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="give the ranks glibc malloc settings that keep freed memory for reuse (GLIBC_TUNABLES "
                        "trim_threshold 256 MiB, mmap_threshold 32 MiB; the inherited value's own settings "
                        "win), so that XLA's fresh buffers are not page-faulted in at every call (default on)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments, after --")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.command and a.command[0] == "--":
        a.command = a.command[1:]
    if a.nprocs < 1:
        p.error(f"-n must be >= 1, got {a.nprocs}")
    if a.devices_per_process is not None and a.gpus_per_process is not None:
        p.error("--devices-per-process sets host (CPU) devices and --gpus-per-process GPUs: give one of them")
    if a.gpus_per_process is not None and a.gpus_per_process < 1:
        p.error(f"--gpus-per-process must be >= 1, got {a.gpus_per_process}")
    if a.devices_per_process is None and a.gpus_per_process is None:
        a.devices_per_process = 1
    if a.devices_per_process is not None and a.devices_per_process < 1:
        p.error(f"--devices-per-process must be >= 1, got {a.devices_per_process}")
    if a.hosts is not None and (a.hosts < 1 or a.nprocs % a.hosts):
        p.error(f"--hosts {a.hosts} must be >= 1 and divide -n {a.nprocs} (each host gets the same number "
                "of consecutive processes)")
    if not 0 < a.timeout < float("inf"):  # a deadline must be one (also refuses nan)
        p.error(f"--timeout must be a finite number of seconds > 0, got {a.timeout}")
    if not a.command:
        p.error("no command to run; put it after --, e.g. "
                f"`{PROG} -n 2 -- python script.py`")
    if a.gpus_per_process is not None:
        # jax's default backend is the first listed; with cpu first, jax.devices() are CPUs, and
        # FlexLink maps the default backend's device ids to processes (hosts.py).
        platforms = os.environ.get("JAX_PLATFORMS")
        if platforms is not None and platforms.split(",")[0].strip() not in ("cuda", "gpu"):
            p.error(f"JAX_PLATFORMS={platforms!r} does not make CUDA jax's default backend, which a "
                    "--gpus-per-process job runs on (unset it, or list cuda first)")
        need = a.nprocs * a.gpus_per_process
        have, how = gpu_count()
        if have is not None and need > have:
            p.error(f"-n {a.nprocs} --gpus-per-process {a.gpus_per_process} needs {need} GPUs; this machine shows "
                    f"{have} ({how})")
    return a


def gpu_count(environ=None, nvml_count=None) -> tuple[int | None, str]:
    """(how many GPUs jax's local_device_ids may name here, how that was counted), or (None, why not).

    jax numbers GPUs as CUDA does, so within CUDA_VISIBLE_DEVICES where it is set; otherwise NVML's
    count (jax_flexlink.topology, which needs nvidia-ml-py). `nvml_count`: a stand-in for tests."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        # CUDA stops at the first entry that is not a device it has; count the list as given.
        return len(entries), f"CUDA_VISIBLE_DEVICES={visible!r}"
    if nvml_count is None:
        def nvml_count():
            from jax_flexlink import topology  # noqa: PLC0415 - NVML only for GPU jobs
            t = topology.discover()
            if not t.nvml.available:
                raise RuntimeError(t.nvml.error or "NVML not available")
            return len(t.gpus)
    try:
        return nvml_count(), "NVML"
    except Exception as e:  # noqa: BLE001 - no count is not an error: jax refuses ids it lacks
        return None, f"not counted: {e}"


def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS's choice). Another program could take it before jax's
    coordinator binds it; the window is the children's start-up, and a failed bind fails the job loudly."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_of(rank: int, nprocs: int, hosts: int) -> int:
    """The emulated host of a rank: consecutive blocks of nprocs/hosts ranks."""
    return rank // (nprocs // hosts)


def with_device_count(xla_flags: str, k: int) -> str:
    """XLA_FLAGS with --xla_force_host_platform_device_count=k, replacing any earlier value."""
    flags = _DEVCOUNT_RE.sub("", xla_flags).split()
    return " ".join(flags + [f"--xla_force_host_platform_device_count={k}"])


def with_malloc_tunables(tunables: str, settings=KEEP_FREED_MEMORY) -> str:
    """GLIBC_TUNABLES ('name=value:name=value') with `settings` added where it does not set them already:
    a value the caller chose wins."""
    entries = [e for e in tunables.split(":") if e]
    have = {e.split("=", 1)[0] for e in entries}
    return ":".join(entries + [f"{name}={value}" for name, value in settings if name not in have])


def child_env(base: dict, rank: int, nprocs: int, devices: int, hosts: int | None, port: int,
              keep_freed_memory: bool = True, gpus: bool = False) -> dict:
    """Rank `rank`'s environment; `devices` per process, GPUs where `gpus`, else host devices."""
    env = {k: v for k, v in base.items() if k not in ENV_VARS}
    if keep_freed_memory:
        env["GLIBC_TUNABLES"] = with_malloc_tunables(base.get("GLIBC_TUNABLES", ""))
    addr = f"127.0.0.1:{port}"
    env.update({"FLEXLINK_COORDINATOR": addr, "FLEXLINK_NUM_PROCESSES": str(nprocs),
                "FLEXLINK_PROCESS_ID": str(rank), "FLEXLINK_DEVICES_PER_PROCESS": str(devices),
                "JAX_COORDINATOR_ADDRESS": addr, "JAX_COORDINATOR_BIND_ADDRESS": addr})
    if gpus:
        # jax numbers GPUs as CUDA does; XLA keeps that numbering for the ones it is given
        # (docs/cuda.md, "Device ids"), so rank i's GPUs are ordinals iK.. in its process too.
        ids = ",".join(str(rank * devices + g) for g in range(devices))
        env["FLEXLINK_LOCAL_DEVICE_IDS"] = env["JAX_LOCAL_DEVICE_IDS"] = ids  # the second: jax's own call
        env.setdefault("JAX_PLATFORMS", "cuda")
    else:
        env["XLA_FLAGS"] = with_device_count(base.get("XLA_FLAGS", ""), devices)
        env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if hosts is not None:
        env["FLEXLINK_HOST_ID"] = f"host{host_of(rank, nprocs, hosts)}"
        env["FLEXLINK_NUM_HOSTS"] = str(hosts)
    return env


def _death_signal_setter():
    """A preexec_fn that makes the kernel SIGKILL the child when the launcher dies (even by SIGKILL,
    where no handler of ours runs). Linux only (prctl PR_SET_PDEATHSIG); elsewhere None, and the
    launcher's own cleanup is all there is. libc is loaded here, in the parent, so that the child runs
    no import between fork and exec."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


class Launcher:
    def __init__(self, args: argparse.Namespace, out=None, err=None):
        self.args = args
        self.out = out or sys.stdout.buffer
        self.err = err or sys.stderr.buffer
        self.lock = threading.Lock()   # one line at a time, whole, on either stream
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.interrupted = 0           # the signal that asked the launcher to stop, 0 if none

    # --- output ---------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        """The launcher's own messages, on stderr, as whole lines."""
        self._write(self.err, f"jax_flexlink.launch: {text}\n".encode())

    def _write(self, stream, data: bytes) -> None:
        with self.lock:
            try:
                stream.write(data)
                stream.flush()
            except (BrokenPipeError, ValueError):  # our reader went away; the job goes on
                pass

    def _pump(self, rank: int, pipe, stream) -> None:
        prefix = f"[{rank}] ".encode()
        with pipe:
            for line in iter(pipe.readline, b""):
                self._write(stream, prefix + (line if line.endswith(b"\n") else line + b"\n"))

    # --- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        a = self.args
        port = free_port()
        preexec = _death_signal_setter()
        for rank in range(a.nprocs):
            if self.interrupted:
                return
            gpus = a.gpus_per_process is not None
            env = child_env(os.environ, rank, a.nprocs, a.gpus_per_process if gpus else a.devices_per_process,
                            a.hosts, port, a.keep_freed_memory, gpus=gpus)
            try:
                # start_new_session: the rank leads its own process group (killpg reaches its children
                # too), and a Ctrl-C at the terminal reaches the launcher only, which stops the ranks.
                p = subprocess.Popen(a.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec)
            except OSError as e:
                raise RuntimeError(f"cannot start rank {rank}: {a.command[0]}: {e.strerror or e}") from e
            self.procs.append(p)
        # Readers start once every rank is forked (a fork while other threads run is the risky kind);
        # a pipe holds 64 KiB, far more than a process prints in the milliseconds this takes.
        for rank, p in enumerate(self.procs):
            for pipe, stream in ((p.stdout, self.out), (p.stderr, self.err)):
                # Daemon threads: a grandchild that escaped the process group and holds the pipe open
                # must not keep the launcher alive (joins below have a deadline).
                t = threading.Thread(target=self._pump, args=(rank, pipe, stream), daemon=True)
                t.start()
                self.readers.append(t)

    def running(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def _signal_groups(self, sig: int, ranks) -> None:
        for r in ranks:
            try:
                os.killpg(self.procs[r].pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone already

    def stop_all(self) -> None:
        """SIGTERM to every rank's process group, SIGKILL after GRACE_S, then reap every rank.

        Groups of ranks that already exited are signalled too: a rank's own children (same group) must
        not outlive the job either."""
        everyone = range(len(self.procs))
        self._signal_groups(signal.SIGTERM, everyone)
        deadline = time.monotonic() + GRACE_S
        while self.running() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        self._signal_groups(signal.SIGKILL, everyone)
        for p in self.procs:
            try:
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:  # unkillable (D state): say so rather than hang
                self.note(f"process {p.pid} did not die after SIGKILL")

    def join_output(self) -> None:
        deadline = time.monotonic() + GRACE_S
        for t in self.readers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    # --- the job --------------------------------------------------------------------------------
    def wait(self) -> int:
        """Until every rank exited 0 (0), one failed (its status), the deadline (124)."""
        deadline = time.monotonic() + self.args.timeout
        while True:
            if self.interrupted:
                name = signal.Signals(self.interrupted).name
                self.note(f"interrupted ({name}); stopping ranks {_ranks(self.running()) or '(none left)'}")
                return 128 + self.interrupted
            for r, p in enumerate(self.procs):
                code = p.poll()
                if code is not None and code != 0:
                    others = [o for o in self.running() if o != r]
                    self.note(f"rank {r} {_describe(code)}"
                              + (f"; stopping ranks {_ranks(others)}" if others else ""))
                    return _exit_status(code)
            still = self.running()
            if not still:
                return 0
            if time.monotonic() >= deadline:
                self.note(f"deadline of {self.args.timeout:g} s passed; ranks {_ranks(still)} still running; "
                          "stopping all")
                return EXIT_TIMEOUT
            time.sleep(_POLL_S)

    def run(self) -> int:
        def on_signal(signum, frame):  # only noted: the loop in wait() stops the ranks
            if not self.interrupted:
                self.interrupted = signum
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            try:
                self.start()
                status = self.wait()
            except RuntimeError as e:
                self.note(str(e))
                status = 1
            # A second Ctrl-C during the cleanup is only noted, so it cannot cut the cleanup short.
            self.stop_all()
            self.join_output()
            return status
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main())
