"""benchmarks/lm_methods.py: each method of the LM benchmarks reaches examples/train_lm.py as written."""

from __future__ import annotations

import pytest

from benchmarks.lm_methods import METHODS, arguments, config_fields, load_example


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_reaches_the_example_command_line_unchanged(name: str) -> None:
    method = METHODS[name]
    args = load_example().argument_parser().parse_args(arguments(name))
    assert (args.optimizer, args.hook) == (method.optimizer, method.hook or "none")
    assert dict(args.opt) == method.options  # types too: repr() there, literal_eval back


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_is_a_valid_train_config(name: str) -> None:
    config = load_example().TrainConfig(steps=10, **config_fields(name))
    assert config.options == METHODS[name].options and config.options is not METHODS[name].options


def test_a_later_option_overrides_the_methods_own() -> None:
    args = load_example().argument_parser().parse_args([*arguments("cadam"), "--opt", "warmup_steps=2"])
    assert dict(args.opt)["warmup_steps"] == 2 and METHODS["cadam"].options["warmup_steps"] == 200


def test_the_example_is_loaded_once() -> None:
    assert load_example() is load_example()
