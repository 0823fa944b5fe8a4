"""generate_lengths and visible_pairs come from the C library: the same batches and FLOP counts as
the C++ benchmarks."""
import pytest

import jagflash

# Batch sizes and length ranges of shared/bench/distributions.md.
SPECS = {"uniform1k": (64, 1024, 1024), "gemskew": (256, 16, 8192), "pareto": (512, 32, 16384),
         "onegiant": (256, 128, 16384), "short": (2048, 16, 256)}


@pytest.mark.parametrize("name", jagflash.DISTRIBUTIONS)
def test_distributions(name):
    batch_size, lo, hi = SPECS[name]
    lengths = jagflash.generate_lengths(name)
    assert len(lengths) == batch_size
    assert all(lo <= n <= hi for n in lengths)
    assert lengths == jagflash.generate_lengths(name, jagflash.DEFAULT_SEED)


def test_same_batch_as_cpp():
    """The first lengths tests/test_generator.cpp pins for the default seed."""
    assert jagflash.DEFAULT_SEED == 20261129
    assert jagflash.generate_lengths("gemskew")[:6] == [1856, 249, 228, 637, 649, 184]
    assert jagflash.generate_lengths("short")[:6] == [173, 243, 59, 25, 34, 120]
    assert jagflash.generate_lengths("gemskew", 1) != jagflash.generate_lengths("gemskew", 2)


def test_unknown_distribution():
    with pytest.raises(jagflash.JagflashError, match="uniform"):
        jagflash.generate_lengths("uniform")


@pytest.mark.parametrize(
    "len_q,len_kv,kwargs,pairs",
    [
        (4, 4, {}, 16),
        (4, 4, {"causal": True}, 10),
        (2, 5, {"causal": True}, 9),  # bottom-right: rows see 4 and 5 keys
        (5, 2, {"causal": True}, 3),  # the first 3 rows see nothing
        (6, 6, {"window": (1, 1)}, 16),
        (0, 7, {}, 0),
    ],
)
def test_visible_pairs(len_q, len_kv, kwargs, pairs):
    assert jagflash.visible_pairs(len_q, len_kv, **kwargs) == pairs


def test_visible_pairs_reports_the_c_error():
    """The C call's -1 (a negative length here) raises with its message instead of being
    returned as a count."""
    with pytest.raises(jagflash.InvalidArgumentError, match=r"len_q and len_kv must be >= 0, got -1 and 4"):
        jagflash.visible_pairs(-1, 4)


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((2**32 + 4, 4), {}, r"len_q: expected an int that fits int32, got 4294967300"),
        ((4, 2.5), {}, r"len_kv: expected an int that fits int32, got 2.5"),
        ((4, 4), {"window": (1.9, 0)}, r"window\[0\]: expected an int"),
        ((4, 4), {"causal": "no"}, r"causal: expected True or False, got 'no'"),
    ],
    ids=["length-past-int32", "float-length", "float-window", "string-causal"],
)
def test_visible_pairs_checks_its_arguments(args, kwargs, message):
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.visible_pairs(*args, **kwargs)
