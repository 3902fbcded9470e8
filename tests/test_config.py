import subprocess
import sys

import pytest
from pydantic import BaseModel

from shipyard.cli.main import main
from shipyard.config import Config, load_config, preset_names, to_yaml
from shipyard.errors import ConfigError
from shipyard.model.transformer import num_params


def test_presets_load_and_marin_8b_count():
    assert {"tiny", "small", "llama3-8b", "marin-8b"} <= set(preset_names())
    marin = load_config("marin-8b")
    assert (marin.model.hidden_size, marin.model.intermediate_size, marin.model.num_layers) == (
        4096,
        14336,
        32,
    )
    assert (marin.model.num_heads, marin.model.num_kv_heads, marin.model.vocab_size) == (32, 8, 128256)
    assert marin.data.seq_len == 4096 and marin.train.schedule.kind == "wsd"
    # Llama-3-8B / Marin-8B have exactly 8,030,261,248 parameters.
    assert num_params(marin.model) == 8_030_261_248
    assert 15e6 <= num_params(load_config("small").model) <= 25e6


def test_overrides_and_yaml_base(tmp_path):
    cfg = load_config(
        "tiny", ["train.optimizer.lr=1e-2", "model.num_layers=4", "model.rope_scaling.factor=4"]
    )
    assert cfg.train.optimizer.lr == 1e-2 and cfg.model.num_layers == 4
    assert cfg.model.rope_scaling.factor == 4 and cfg.model.rope_scaling.low_freq_factor == 1.0
    f = tmp_path / "exp.yaml"
    f.write_text("base: tiny\ntrain:\n  steps: 70\n")
    cfg = load_config(str(f), ["train.seed=3"])
    assert cfg.train.steps == 70 and cfg.train.seed == 3 and cfg.model.hidden_size == 64
    # the resolved YAML round-trips to the same config
    g = tmp_path / "resolved.yaml"
    g.write_text(to_yaml(cfg))
    assert load_config(str(g)) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.optimizer.lr=-1", "train.optimizer.lr"),
        ("model.num_heads=5", "model.num_heads"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("train.lrr=3", "train.lrr: unknown key"),
        ("model.hidden_size=abc", "model.hidden_size"),
        ("train.microbatches=3", "train.microbatches"),
        ("data.seq_len=100000", "data.seq_len"),
        ("train.optimizer=3", "train.optimizer"),
        ("novalue", "expected dotted.key=value"),
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file and no preset"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def _schemas(model=Config, seen=None):
    seen = set() if seen is None else seen
    if model in seen:
        return seen
    seen.add(model)
    for field in model.model_fields.values():
        for t in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(t, type) and issubclass(t, BaseModel):
                _schemas(t, seen)
    return seen


def test_every_field_has_a_docstring():
    from shipyard.data.configs import PrepareConfig

    missing = [
        f"{m.__name__}.{name}"
        for m in _schemas() | _schemas(PrepareConfig)
        for name, field in m.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not missing, missing


def test_config_show_ends_with_exact_param_count_and_flops(capsys):
    assert main(["config", "show", "tiny", "model.num_layers=3"]) == 0
    out = capsys.readouterr().out
    last = out.rstrip().splitlines()[-1]
    n = num_params(load_config("tiny", ["model.num_layers=3"]).model)
    assert f"# parameters: {n} (" in out and f"# active parameters per token: {n} (" in out
    assert last.startswith("# training FLOPs per token at seq_len 128: ")


def test_cli_bad_value_is_one_line_exit_2_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "shipyard.cli.main", "config", "show", "tiny", "train.optimizer.lr=-0.1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.optimizer.lr" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_bad_flag_is_one_line(capsys):
    assert main(["train", "tiny", "--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no-such-flag" in err[0]


def test_debug_shows_traceback():
    with pytest.raises(ConfigError):
        main(["--debug", "config", "show", "tiny", "model.num_kv_heads=3"])


def test_unwritable_output_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["data", "bytes", "--out", str(blocker / "sub" / "tokens.npy"), "--max-bytes", "1000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(blocker) in err[0]


def test_overrides_may_follow_flags(capsys):
    assert main(["config", "show", "tiny", "model.num_layers=3"]) == 0
    before = capsys.readouterr().out
    assert main(["--debug", "config", "show", "tiny", "model.num_layers=3"]) == 0
    assert capsys.readouterr().out == before
    assert (
        main(["train", "tiny", "--overwrite", "train.steps=-1"]) == 2
    )  # parsed as an override, then rejected
    assert "train.steps" in capsys.readouterr().err
    assert main(["data", "stdlib", "--out", "x", "model.num_layers=3"]) == 2  # no overrides there
