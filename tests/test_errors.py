"""Bad checkpoints and config.json files give one clear line (or a short summary), through
the API and both commands."""
import json
import os
import re
import shutil

import pytest

import dsv4_jax as dj
from dsv4_jax.__main__ import main
from dsv4_jax.checkpoints import CheckpointError


def with_config(src, dst, **changes):
    """A copy of the checkpoint at ``src`` whose config.json has ``changes`` (None deletes)."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "config.json")
    with open(file) as f:
        hf = json.load(f)
    for key, value in changes.items():
        if value is None:
            del hf[key]
        else:
            hf[key] = value
    with open(file, "w") as f:
        json.dump(hf, f)
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=None), "required key 'hidden_size' is missing"),
    (dict(num_hidden_layers=None), "required key 'num_hidden_layers' is missing"),
    (dict(hidden_size="256"), "key 'hidden_size' must be an integer, got '256'"),
    (dict(compress_ratios=4), "key 'compress_ratios' must be a list of integers, got 4"),
    (dict(rope_scaling="yarn"), "key 'rope_scaling' must be an object, got 'yarn'"),
    (dict(rms_norm_eps="small"), "key 'rms_norm_eps' must be a number, got 'small'"),
])
def test_bad_config_json_key_is_one_line_naming_key_and_file(hf_checkpoint, tmp_path, capsys,
                                                             changes, message):
    bad = with_config(hf_checkpoint.path, str(tmp_path / "bad"), **changes)
    file = os.path.join(bad, "config.json")
    with pytest.raises(ValueError) as err:
        dj.Config.from_hf(bad)
    assert str(err.value) == f"{file}: {message}"
    with pytest.raises(ValueError, match="^" + re.escape(file)):
        dj.load(bad)
    assert main(["generate", "--model", bad, "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"error: {file}: {message}"
    assert main(["convert", bad, str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == f"convert: error: {file}: {message}"


def test_config_json_that_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    file = tmp_path / "config.json"
    with pytest.raises(ValueError, match="^" + re.escape(f"{file} is not valid JSON")):
        dj.Config.from_hf(tmp_path)


def test_hidden_size_that_does_not_match_the_tensors_is_summarised(hf_checkpoint, tmp_path):
    cfg = hf_checkpoint.config
    bad = with_config(hf_checkpoint.path, str(tmp_path / "bad"), hidden_size=cfg.dim * 2)
    with pytest.raises(CheckpointError) as err:
        dj.load(bad)
    lines = str(err.value).splitlines()
    # the cause first, then 10 tensors, then the count of the rest
    assert lines[0].startswith(f"checkpoint {bad} does not match its config.json "
                               f"(hidden_size is {cfg.dim * 2} in config.json, but ")
    assert f"tensors have {cfg.dim} there)" in lines[0]
    assert len(lines) == 12 and lines[-1].startswith("  ... and ") and lines[-1].endswith(" more")
    listed = int(lines[-1].split()[2]) + 10
    assert listed > 20
