"""The README's try-it path: `nanoserve make-tiny-model` then `nanoserve generate`, as a newcomer runs them."""
import dataclasses
import json
import socket
import stat
import subprocess
import sys

import pytest

from nanoserve import __version__
from nanoserve.cli import _build_parser, engine_config_from_args, main
from nanoserve.config import (FIELD_HELP, SERVE_CHUNK_TIME_RATIO, SERVE_DEFAULTS, SERVE_MAX_NUM_BATCHED_TOKENS,
                              EngineConfig)


def run_cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=timeout)


def test_make_tiny_model_then_generate(tmp_path):
    made = run_cli("make-tiny-model", str(tmp_path / "tiny"), "--arch", "qwen2")
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE((tmp_path / "tiny").stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "tiny").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes  # readable by others
    gen = run_cli("generate", "--model", str(tmp_path / "tiny"), "--prompt", "Hello", "--prompt", "Bye",
                  "--max-tokens", "5", "--device", "cpu", "--max-model-len", "64", "--enforce-eager")
    assert gen.returncode == 0, gen.stderr
    lines = [json.loads(line) for line in gen.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello", "Bye"]
    assert all(x["num_tokens"] <= 5 and x["finish_reason"] in ("stop", "length") for x in lines)
    assert "decode runs eagerly" in gen.stderr  # the start-up log line


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/folder", "--prompt", "x"], "does not exist"),
    (["generate", "--model", ".", "--prompt", "x", "--dtype", "int3"], "dtype"),
])
def test_bad_input_is_one_clear_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_generate_on_the_real_gguf_knows_paris(smollm2_gguf):
    gen = run_cli("generate", "--model", str(smollm2_gguf), "--prompt", "The capital of France is",
                  "--max-tokens", "8", "--device", "cpu", "--max-model-len", "512", timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in json.loads(gen.stdout)["text"]


def test_a_broken_gguf_is_one_clear_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    out = run_cli("generate", "--model", str(bad), "--prompt", "x")
    assert out.returncode == 2
    assert "truncated or corrupt" in out.stderr and out.stderr.count("\n") == 1, out.stderr


ENGINE_COMMANDS = {"serve": ["serve", "--model", "m"], "generate": ["generate", "--model", "m", "--prompt", "p"],
                   **{f"bench {c}": ["bench", c, "--model", "m"] for c in ("latency", "throughput", "graphs")}}


def engine_helps(argv: list[str]) -> dict[str, str]:
    """dest → help of the parser that parses argv (the subcommand's own)."""
    parser = _build_parser()
    for word in argv[:2] if argv[0] == "bench" else argv[:1]:
        parser = parser._subparsers._group_actions[0].choices[word]  # argparse keeps subparsers here
    return {a.dest: a.help for a in parser._actions}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_every_engine_field_shows_the_default_the_command_really_uses(command):
    """Each field's help is its own metadata; its "(default: X)" is the config the command builds when the flag is
    left out, and where that is None, what the field says None stands for, checked against the resolved config."""
    argv = ENGINE_COMMANDS[command]
    args = _build_parser().parse_args(argv)
    config = engine_config_from_args(args)
    resolved = config.resolve(model_max_len=10 ** 6, model_dtype=None)
    helps = engine_helps(argv)
    for f in dataclasses.fields(EngineConfig):
        assert FIELD_HELP[f.name] == f.metadata["help"] and helps[f.name].startswith(f.metadata["help"]), f.name
        if f.name == "model":
            continue
        value = getattr(config, f.name)
        if value is None:
            shown = f.metadata["unset"]
            if shown and shown.isdigit():  # a number None stands for: the one resolve() fills in
                assert str(getattr(resolved, f.name)) == shown, (command, f.name)
        else:
            shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert helps[f.name].endswith(f"(default: {shown})" if shown else f.metadata["help"]), (command, f.name)
    assert f"capped at {resolved.max_model_len}" in helps["max_model_len"]


def test_serve_help_shows_its_own_defaults():
    out = run_cli("serve", "--help").stdout
    text = " ".join(out.split())  # argparse wraps the help
    assert f"(default: {SERVE_MAX_NUM_BATCHED_TOKENS})" in text and f"(default: {SERVE_CHUNK_TIME_RATIO})" in text


def parse(*flags):
    return _build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", *flags])


@pytest.mark.parametrize("word, value", [("true", True), ("YES", True), ("1", True), ("False", False),
                                         ("no", False), ("0", False)])
def test_bool_flags_take_the_usual_words(word, value):
    assert parse("--enable-prefix-caching", word).enable_prefix_caching is value
    assert parse("--enforce-eager", word).enforce_eager is value


def test_bool_flag_alone_means_true_and_a_typo_is_an_error(capsys):
    assert parse("--enforce-eager").enforce_eager is True
    assert parse().enable_prefix_caching is None  # not given: the config's default applies
    with pytest.raises(SystemExit) as exit_:
        parse("--enable-prefix-caching", "flase")
    assert exit_.value.code == 2
    assert "expected true/false, yes/no or 1/0, got 'flase'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"nanoserve {__version__}"


def test_serve_refuses_a_busy_port_before_loading_the_model(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--model", "/no/such/model", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot serve on 127.0.0.1:{port}" in err and "does not exist" not in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("flag, expected", [
    ([], (SERVE_MAX_NUM_BATCHED_TOKENS, SERVE_CHUNK_TIME_RATIO)),
    (["--max-num-batched-tokens", "8192"], (8192, SERVE_CHUNK_TIME_RATIO)),
    (["--chunk-time-ratio", "0"], (SERVE_MAX_NUM_BATCHED_TOKENS, 0.0))])
def test_serve_defaults_to_the_serving_token_budget(monkeypatch, tmp_path, flag, expected):
    """`serve` sizes its steps for the streams' ITL (config.SERVE_MAX_NUM_BATCHED_TOKENS, SERVE_CHUNK_TIME_RATIO);
    a given flag wins."""
    import nanoserve.server.app as app

    seen = {}
    monkeypatch.setattr(app, "serve", lambda config, **kw: seen.setdefault("config", config) and 0)
    assert main(["serve", "--model", str(tmp_path), "--port", "0", *flag]) == 0
    assert (seen["config"].max_num_batched_tokens, seen["config"].chunk_time_ratio) == expected
    with pytest.raises(ValueError, match="chunk_time_ratio must be 0"):
        EngineConfig(model="m", chunk_time_ratio=0.5)


def test_serve_a_missing_model_answers_before_torch_is_imported():
    """`nanoserve serve /nonexistent`: one line in a fraction of a second (it took 5 s of imports)."""
    code = ("import sys, time; from nanoserve.cli import main; t = time.monotonic(); "
            "code = main(['serve', '/no/such/model', '--port', '0']); "
            "print(code, round(time.monotonic() - t, 2), 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    rc, seconds, torch_in, transformers_in = out.stdout.split()
    assert rc == "2" and "does not exist" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert float(seconds) <= 0.5 and torch_in == transformers_in == "False", out.stdout


def test_models_lists_what_runs_and_what_is_refused(capsys):
    from nanoserve.model_files import REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUPPORTED_ARCHITECTURES) and "qwen3moe" in out
    assert all(f"{name}: {why}" in out for name, why in REFUSED_ARCHITECTURES.items())


def test_the_cli_imports_without_torch():
    """`nanoserve models` and the parser (tiny.ARCHS included) answer without importing torch."""
    code = "import sys; from nanoserve.cli import main; main(['models']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


def test_make_tiny_model_takes_the_moe_archs(tmp_path):
    assert main(["make-tiny-model", str(tmp_path / "m"), "--arch", "mixtral"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
