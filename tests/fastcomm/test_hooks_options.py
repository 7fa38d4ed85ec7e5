"""Every state option is checked for its type as well as its value, with an error naming both.

A value of the wrong type that passes a range check (``bits=8.0``, ``chunk=True``) would otherwise be
accepted and fail later inside backward with an error that names neither. Type errors are
``TypeError`` and ``ValueError`` at once (``fastcomm.hooks.engine.options.OptionTypeError``), so code catching
the documented ``ValueError`` keeps working.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _fault_workers as faults  # noqa: E402

import fastcomm  # noqa: E402
from fastcomm.collectives._layout import piece_ranges  # noqa: E402
from fastcomm.hooks import sign  # noqa: E402

TopK, Quant, Sign, Cast = fastcomm.TopKState, fastcomm.QuantState, fastcomm.SignState, fastcomm.CastState

# (state class, option, bad value): one case each
BAD = [
    (TopK, "ratio", True),
    (TopK, "ratio", "0.1"),
    (TopK, "ratio", None),
    (TopK, "ratio", 0.0),
    (TopK, "exact", 1),
    (TopK, "exact", "yes"),
    (TopK, "momentum", True),
    (TopK, "momentum", "0.9"),
    (TopK, "warmup_ratios", "0.5"),
    (TopK, "warmup_ratios", (True,)),
    (TopK, "warmup_ratios", ()),
    (TopK, "warmup_steps", 10.0),
    (TopK, "warmup_steps", True),
    (TopK, "warmup_steps", -1),
    (TopK, "error_feedback", 1),
    (TopK, "error_feedback", "no"),
    (TopK, "error_feedback", None),
    (TopK, "start_iter", 1.0),
    (TopK, "start_iter", True),
    (TopK, "start_iter", -1),
    (TopK, "min_compress_numel", 1024.0),
    (TopK, "min_compress_numel", False),
    (TopK, "wire_chunk_bytes", 4096.0),
    (TopK, "wire_chunk_bytes", True),
    (TopK, "wire_chunk_bytes", 0),
    (TopK, "process_group", "world"),
    (TopK, "process_group", 0),
    (Quant, "bits", 8.0),
    (Quant, "bits", True),
    (Quant, "bits", "8"),
    (Quant, "bits", 3),
    (Quant, "block", 256.0),
    (Quant, "block", True),
    (Quant, "block", 0),
    (Quant, "stochastic", 1),
    (Quant, "stochastic", "no"),
    (Quant, "seed", 0.0),
    (Quant, "seed", True),
    (Quant, "seed", "0"),
    (Quant, "overlap_phase2", 1),
    (Quant, "overlap_phase2", "yes"),
    (Quant, "error_feedback", 0),
    (Quant, "start_iter", 2.5),
    (Quant, "process_group", object()),
    (Sign, "chunk", 2048.0),
    (Sign, "chunk", True),
    (Sign, "chunk", "2048"),
    (Sign, "chunk", 0),
    (Sign, "overlap_phase2", 0),
    (Sign, "error_feedback", "yes"),
    (Sign, "min_compress_numel", -5),
    (Cast, "dtype", "bf16"),
    (Cast, "dtype", torch.int8),
    (Cast, "dtype", float),
    (Cast, "process_group", "world"),
]


def _case_id(case: tuple) -> str:
    cls, option, value = case
    shown = "instance" if type(value) is object else repr(value)  # an object's repr holds its address
    return f"{cls.__name__}-{option}-{type(value).__name__}-{shown}"


@pytest.mark.parametrize(("cls", "option", "value"), BAD, ids=[_case_id(c) for c in BAD])
def test_bad_option_is_rejected_naming_option_and_value(cls, option, value):
    with pytest.raises(ValueError) as caught:  # every bad option is a ValueError (wrong types: TypeError too)
        cls(**{option: value})
    message = str(caught.value)
    assert option in message, message
    assert repr(value) in message, message


# a float where an int is needed, a bool anywhere but a flag: these are type errors
TYPE_ERRORS = [
    (Quant, "bits", 8.0),
    (Quant, "stochastic", 1),
    (TopK, "error_feedback", 1),
    (TopK, "start_iter", 1.0),
    (Cast, "dtype", "bf16"),
    (Sign, "process_group", "world"),
]


@pytest.mark.parametrize(("cls", "option", "value"), TYPE_ERRORS, ids=[_case_id(c) for c in TYPE_ERRORS])
def test_wrong_type_is_a_type_error(cls, option, value):
    with pytest.raises(TypeError, match=option):
        cls(**{option: value})


GOOD = [
    (TopK, {"ratio": 1}),  # an int where a real is wanted is a real
    (TopK, {"momentum": 0}),
    (TopK, {"warmup_ratios": [0.5, 0.1], "warmup_steps": 10}),
    (Quant, {"bits": 2, "block": 64, "stochastic": False, "seed": -3}),
    (Sign, {"chunk": 3}),
    (Sign, {"chunk": 1}),
    (Cast, {"dtype": torch.float16}),
]


@pytest.mark.parametrize(("cls", "options"), GOOD, ids=[f"{c.__name__}-{o}" for c, o in GOOD])
def test_good_options_are_kept(cls, options):
    state = cls(**options)
    for name, value in options.items():
        kept = state.options()[name]
        assert kept == (tuple(value) if isinstance(value, list) else value), (name, kept)


@pytest.mark.parametrize("chunk", [1, 3, 5, 12, 2048])
def test_any_positive_chunk_lays_out_whole_bytes_and_chunks(chunk):
    """Why ``chunk=3`` is valid: segments and pieces are multiples of ``lcm(chunk, 8)`` elements."""
    for numel in (7, 300, 3001, 100_003):
        for world_size in (2, 3, 4):
            segment, used = sign.sign_layout(numel, world_size, chunk)
            assert segment * world_size >= numel
            assert segment % 8 == 0 and segment % used == 0, (numel, world_size, segment, used)
            unit = math.lcm(used, 8)
            for start, stop in piece_ranges(segment, unit, segment // 8 + 4 * segment // used, 64):
                assert start % unit == 0 and (stop % unit == 0 or stop == segment), (start, stop)


def test_sign_chunk_not_a_multiple_of_8_matches_reference(tmp_path):
    faults.spawn_preloaded(tmp_path, 2, faults.odd_chunk_worker)
