"""Flag parsing of jax_flexlink.bench (no jax needed)."""
import pytest

from jax_flexlink.bench import cli, timing


def test_defaults_are_the_main_job():
    c = cli.parse([])
    assert c.sizes[0] == 4 << 10 and c.sizes[-1] == 64 << 20 and len(c.sizes) == 15
    assert c.collectives == ["all_reduce", "all_gather"] and c.ops == ["sum"] and c.dtypes == ["float"]
    assert c.devices == 8 and c.modes == [False, True] and c.baseline == "native" and c.check
    assert c.iters is None and c.scenario == "host8" and c.links is None and c.impl == "flexlink"


def test_flags():
    c = cli.parse("-b 1K -e 1M -f 4 -o max,min -d half -C all -n 7 -w 0 -c 0 --devices 4 --inplace "
                  "--baseline none --links shm;tcp --json x.json --seed 9".split())
    assert c.sizes == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert c.ops == ["max", "min"] and c.dtypes == ["half"] and len(c.collectives) == 5
    assert (c.iters, c.warmup, c.check, c.devices, c.modes) == (7, 0, False, 4, [True])
    assert (c.baseline, c.links, c.json_path, c.seed) == ("none", "shm;tcp", "x.json", 9)
    assert cli.parse(["--outofplace"]).modes == [False]
    assert cli.parse(["--both"]).modes == [False, True]
    assert cli.parse(["-b", "1K", "-e", "4K", "-i", "1K"]).sizes == [1024, 2048, 3072, 4096]


def test_ppermute_and_all_to_all():
    c = cli.parse(["-C", "ppermute,all_to_all"])
    assert c.collectives == ["ppermute", "all_to_all"] and c.settings["collectives"] == c.collectives
    assert c.ops == ["sum"]  # -o is irrelevant to them; the table says 'none'
    assert cli.parse(["-C", "sendrecv,alltoall"]).collectives == ["ppermute", "all_to_all"]
    assert cli.parse(["-C", "all-to-all,ppermute"]).collectives == ["all_to_all", "ppermute"]
    assert cli.parse(["-C", "all"]).collectives == ["all_reduce", "all_gather", "reduce_scatter", "ppermute",
                                                    "all_to_all"]
    assert "ppermute" not in cli.parse([]).collectives  # the default stays README's main job


def test_scenario_defaults_and_overrides():
    c = cli.parse(["--scenario", "emulated-h800"])
    assert c.links and "emulated" in c.links and c.sizes[0] == 64 << 10 and c.sizes[-1] == 64 << 20
    assert cli.parse(["--scenario", "emulated-h800", "--links", "shm"]).links == "shm"
    assert cli.parse(["--scenario", "emulated-h800", "-b", "1M", "-e", "1M"]).sizes == [1 << 20]


def test_runs():
    assert cli.parse([]).runs == 1 and cli.parse([]).settings["runs"] == 1  # call by call by default
    c = cli.parse(["--runs", "8"])
    assert c.runs == 8 and c.settings["runs"] == 8
    # Turns get a pause before each by default; call by call has no turns and no pause.
    assert c.turn_pause_ms == timing.DEFAULT_TURN_PAUSE_MS == 5.0 and c.settings["turn_pause_ms"] == 5.0
    assert cli.parse([]).turn_pause_ms == 0.0 and cli.parse([]).settings["turn_pause_ms"] == 0.0
    assert cli.parse(["--runs", "8", "--turn-pause-ms", "0"]).turn_pause_ms == 0.0
    assert cli.parse(["--runs", "2", "--turn-pause-ms", "2.5"]).turn_pause_ms == 2.5


@pytest.mark.parametrize("argv, message", [
    (["--turn-pause-ms", "5"], "--turn-pause-ms applies only with --runs > 1"),
    (["--runs", "1", "--turn-pause-ms", "5"], "--turn-pause-ms applies only with --runs > 1"),
    (["--runs", "4", "--turn-pause-ms", "-1"], "--turn-pause-ms must be from 0 to 1000, got -1"),
    (["--runs", "4", "--turn-pause-ms", "nan"], "--turn-pause-ms must be from 0 to 1000, got nan"),
])
def test_turn_pause_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_gpu_scenario():
    c = cli.parse(["--scenario", "gpu"])
    assert (c.platform, c.devices, c.links) == ("gpu", 0, None)  # 0: every GPU jax sees
    assert c.sizes[0] == 4 << 10 and c.sizes[-1] == 256 << 20 and len(c.sizes) == 9
    assert cli.parse(["--scenario", "gpu", "--devices", "2"]).devices == 2
    assert cli.parse([]).platform == "cpu"


@pytest.mark.parametrize("argv", [["-b", "4X"], ["-b", "1M", "-e", "1K"], ["-o", "avg"], ["-d", "fp8"],
                                  ["-C", "bcast"], ["--scenario", "nope"], ["--inplace", "--outofplace"],
                                  ["--baseline", "nccl"], ["-c", "2"], ["--devices", "0"], ["-n", "-1"],
                                  ["--runs", "0"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_running(capsys):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    with pytest.raises(SystemExit):
        cli.parse(["--plot", "x.png"])
    assert "matplotlib" in capsys.readouterr().err


def test_help_mentions_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["--help"])
    out = capsys.readouterr().out
    for flag in ("--minbytes", "--maxbytes", "--stepfactor", "--stepbytes", "--op", "--datatype", "--iters",
                 "--warmup_iters", "--check", "--collective", "--devices", "--links", "--inplace",
                 "--outofplace", "--both", "--baseline", "--json", "--plot", "--scenario", "emulated-h800", "--runs",
                 "--turn-pause-ms"):
        assert flag in out
    assert "--_impl" not in out
    assert "ppermute" in out and "all_to_all" in out and "SendRecv" in out


def test_set_device_count_replaces():
    env = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2"}
    cli.set_device_count(8, env)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=8"]
    env = {}
    cli.set_device_count(4, env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
