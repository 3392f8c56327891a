"""One option, one place: every `DiceConfig` field declares its help, every command that builds an
encoder gets one flag per field generated from it, and the parsed flags give back the same config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dice_fast.cli import build_parser
from dice_fast.cliargs import add_encoder_arguments, encoder_flag, encoder_options
from dice_fast.config import DiceConfig, option

# every subcommand that builds an encoder, with the arguments it requires
ENCODER_COMMANDS = {
    "encode": ["in.jsonl", "-o", "out.npy"],
    "eval": [],
    "bench": [],
    "serve": [],
    "bench-serve": [],
    "index": ["in.jsonl", "-o", "my.index"],
}


def parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *ENCODER_COMMANDS[command], *flags])


def config_of(command: str, *flags: str) -> DiceConfig:
    return DiceConfig(**encoder_options(parse(command, *flags)))


def option_strings(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {s for a in sub._actions for s in a.option_strings}


def test_every_field_declares_help_and_what_a_none_default_means():
    for field in dataclasses.fields(DiceConfig):
        assert field.metadata.get("help"), f"DiceConfig.{field.name} has no help"
        if field.default is None:
            assert field.metadata.get("default_help"), f"DiceConfig.{field.name}: what does None mean?"


@pytest.mark.parametrize("command", ENCODER_COMMANDS)
def test_every_command_that_builds_an_encoder_has_every_field_as_a_flag(command):
    have = option_strings(command)
    missing = [encoder_flag(f)[0] for f in dataclasses.fields(DiceConfig) if encoder_flag(f)[0] not in have]
    assert not missing, f"dice-fast {command} lacks {missing}"
    assert set(encoder_options(parse(command))) == set(DiceConfig.field_names())


@pytest.mark.parametrize("command", ENCODER_COMMANDS)
def test_defaults_round_trip(command):
    assert config_of(command) == DiceConfig()


def test_flags_kept_their_names_and_forms():
    """The flags as they were before they were generated (scripts use them)."""
    have = option_strings("encode")
    for flag in ("--model", "--chunk-size", "--overlap", "--positions", "--pooling", "--aggregation", "--top-k",
                 "--temperature", "--normalize-chunks", "--no-normalize-chunks", "--no-normalize", "--truncate-dim",
                 "--strategy", "--attention", "--attention-backend", "--document-prefix", "--query-prefix",
                 "--max-chunks-per-document", "--max-length", "--max-batch-tokens", "--device", "--dtype",
                 "--pooling-impl"):
        assert flag in have, flag
    assert "--normalize" not in have  # normalize is on by default: only its negation is a flag


NON_DEFAULT = [
    (["--chunk-size", "128", "--overlap", "16", "--aggregation", "topk_norm", "--top-k", "3"],
     dict(chunk_size=128, overlap=16, aggregation="topk_norm", top_k=3)),
    (["--no-normalize", "--normalize-chunks", "--truncate-dim", "64", "--positions", "global"],
     dict(normalize=False, normalize_chunks=True, truncate_dim=64, positions="global")),
    (["--no-normalize-chunks", "--aggregation", "softmax_norm", "--temperature", "0.5", "--pooling", "cls",
      "--strategy", "single", "--max-length", "128"],
     dict(normalize_chunks=False, aggregation="softmax_norm", temperature=0.5, pooling="cls", strategy="single",
          max_length=128)),
    (["--attention", "bidirectional", "--attention-backend", "padded", "--document-prefix", "passage: ",
      "--query-prefix", "query: ", "--max-chunks-per-document", "4", "--max-batch-tokens", "2048",
      "--device", "cpu", "--dtype", "float32", "--pooling-impl", "torch"],
     dict(attention="bidirectional", attention_backend="padded", document_prefix="passage: ", query_prefix="query: ",
          max_chunks_per_document=4, max_batch_tokens=2048, device="cpu", dtype="float32", pooling_impl="torch")),
]


@pytest.mark.parametrize("flags, expected", NON_DEFAULT)
@pytest.mark.parametrize("command", ["encode", "serve", "index"])
def test_non_default_command_lines_round_trip(command, flags, expected):
    assert config_of(command, *flags) == DiceConfig(**expected)


def test_a_bad_choice_is_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse("encode", "--pooling-impl", "fast")
    assert "--pooling-impl" in capsys.readouterr().err


def _flags_of(config_cls) -> dict[str, dict]:
    return dict(encoder_flag(f, config_cls) for f in dataclasses.fields(config_cls))


def test_a_new_field_with_help_is_all_a_new_flag_needs():
    @dataclasses.dataclass(frozen=True)
    class Extended(DiceConfig):
        dedup: bool = option(True, "run identical chunks once per call")
        compile: bool = option(False, "compile the forward")
        budget: float | None = option(None, "seconds to spend", default_help="unbounded", metavar="S")

    flags = _flags_of(Extended)
    assert flags["--no-dedup"]["action"] == "store_false" and flags["--no-dedup"]["help"].startswith("do not run")
    assert flags["--compile"]["action"] == "store_true"
    assert flags["--budget"]["type"] is float and "(default: unbounded)" in flags["--budget"]["help"]
    p = argparse.ArgumentParser()
    add_encoder_arguments(p, Extended)
    args = p.parse_args(["--no-dedup", "--budget", "2.5", "--chunk-size", "64"])
    opts = encoder_options(args, Extended)
    assert Extended(**opts) == Extended(dedup=False, budget=2.5, chunk_size=64)
    assert Extended(**encoder_options(p.parse_args([]), Extended)) == Extended()


def test_a_field_without_help_or_with_an_unexplained_none_has_no_flag():
    @dataclasses.dataclass(frozen=True)
    class Bare(DiceConfig):
        dedup: bool = True

    @dataclasses.dataclass(frozen=True)
    class Unexplained(DiceConfig):
        budget: int | None = option(None, "seconds to spend")

    with pytest.raises(TypeError, match="DiceConfig.dedup has no help"):
        _flags_of(Bare)
    with pytest.raises(TypeError, match="budget defaults to None"):
        _flags_of(Unexplained)
