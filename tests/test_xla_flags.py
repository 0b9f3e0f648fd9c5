"""The XLA flags importing dsv4_jax sets (``dsv4_jax/_xla_flags.py``): which are added, which
a user's own ``XLA_FLAGS`` or opt-out keeps out, and that XLA accepts them (an unknown flag
stops the backend at its start)."""
import json
import os
import subprocess
import sys

import pytest

_PROBE = ("import os, json, jax, dsv4_jax as dj; jax.devices(); print(json.dumps(["
          "os.environ['XLA_FLAGS'], dj.EXACT_ROUNDING, dj.DEVICE_LOOPS, dj.NO_WEIGHT_MERGING, "
          "dj.CONCURRENT_COMMAND_BUFFERS]))")


def _import_flags(**env) -> tuple:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("XLA_FLAGS", "DSV4_DOT_MERGER", "DSV4_COMMAND_BUFFERS",
                          "DSV4_ALLOW_EXCESS_PRECISION", "DSV4_COMMAND_SCHEDULING")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, "JAX_PLATFORMS": "cpu",
                                                              **env},
                         capture_output=True, text=True, timeout=120, check=True)
    flags, *states = json.loads(out.stdout.strip().splitlines()[-1])
    return flags.split(), states


def test_importing_the_package_sets_the_four_flags_and_xla_accepts_them():
    flags, states = _import_flags()
    assert "--xla_allow_excess_precision=false" in flags
    assert any(f.startswith("--xla_gpu_enable_command_buffer=") for f in flags)
    assert "--xla_gpu_dot_merger_threshold_mb=0" in flags
    assert "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" in flags
    assert states == [True, True, True, True]


# (user's environment, the flag's name, what the user's setting leaves, the state's index)
_KEPT_SETTINGS = [
    ({"XLA_FLAGS": "--xla_gpu_dot_merger_threshold_mb=32"}, "dot_merger",
     "--xla_gpu_dot_merger_threshold_mb=32", 2),
    ({"DSV4_DOT_MERGER": "xla"}, "dot_merger", None, 2),
    ({"XLA_FLAGS": "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE"}, "scheduling_mode",
     "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", 3),
    ({"DSV4_COMMAND_SCHEDULING": "xla"}, "scheduling_mode", None, 3),
]


@pytest.mark.parametrize("env, name, kept, state", _KEPT_SETTINGS)
def test_a_users_setting_or_opt_out_is_left_as_it_is(env, name, kept, state):
    flags, states = _import_flags(**env)
    assert [f for f in flags if name in f] == ([kept] if kept else [])
    assert states[state] is False
    assert all(states[:state] + states[state + 1:])


def test_a_users_command_buffer_setting_is_left_as_it_is():
    flags, states = _import_flags(XLA_FLAGS="--xla_gpu_enable_command_buffer=")
    assert [f for f in flags if "enable_command_buffer" in f] == [
        "--xla_gpu_enable_command_buffer="]
    assert states == [True, False, True, True]
