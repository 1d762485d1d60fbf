"""vgpu-ctl's quantities: memory sizes and SM shares as operators write them."""
import pytest

from vgpu.quantities import (UNLIMITED, format_duration_ns, format_memory, format_memory_exact, format_share,
                             parse_memory, parse_share)

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("text,value", [
    ("4Gi", 4 * GiB), ("512Mi", 512 * MiB), ("1.5Gi", 1536 * MiB), ("1073741824", GiB), ("64Ki", 65536),
    ("1Ti", 1 << 40), ("4G", 4 * 10**9), ("500M", 500 * 10**6), ("2k", 2000), ("max", UNLIMITED),
    ("unlimited", UNLIMITED), (" 8Gi ", 8 * GiB),
])
def test_memory_sizes_parse_like_kubernetes_quantities(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["", "4GB", "4gi", "-1Gi", "Gi", "4 Gi", "1.3", "0.1", "abc", "4Gi5", "1e9",
                                  "99999999999Ei"])
def test_malformed_memory_sizes_are_refused_with_what_is_accepted(text):
    with pytest.raises(ValueError) as e:
        parse_memory(text)
    assert repr(text) in str(e.value) or "too large" in str(e.value)


@pytest.mark.parametrize("text,value", [("50%", 5000), ("50", 5000), ("100%", 10000), ("12.5%", 1250),
                                        ("0.01%", 1), ("0.5%", 50), ("1", 100), ("1.5", 150)])
def test_sm_shares_parse_to_hundredths_of_a_percent(text, value):
    assert parse_share(text) == value


@pytest.mark.parametrize("text", ["0", "0%", "101%", "150", "-5", "50%%", "half", "12.345%", ""])
def test_sm_shares_outside_one_to_hundred_percent_are_refused(text):
    with pytest.raises(ValueError):
        parse_share(text)


@pytest.mark.parametrize("text,meant", [("4", "4Gi"), ("1", "1Gi"), ("1.5", "1.5Gi"), ("512", "512Mi"),
                                       ("4096", "4096Mi"), ("1048575", "1048575Mi")])
def test_a_size_without_a_unit_below_1mi_is_a_unit_left_out(text, meant):
    """`--memory 4` was a 4-byte cap, taken silently."""
    with pytest.raises(ValueError) as e:
        parse_memory(text)
    assert f"{text!r} has no unit, so it is {text} bytes" in str(e.value) and "at least 1Mi" in str(e.value)
    assert e.value.hint == f"did you mean {meant}?"


@pytest.mark.parametrize("text,value", [("0", 0), ("1048576", MiB), ("4Ki", 4096), ("2k", 2000), ("0.5Ki", 512)])
def test_sizes_with_a_unit_or_from_1mi_or_0_are_taken_as_written(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text,meant", [("0.5", "50%"), ("0.25", "25%"), ("0.01", "1%"), ("0.99", "99%")])
def test_a_share_without_percent_below_1_is_a_fraction_not_a_share(text, meant):
    """`--sm 0.5` was half a percent of the GPU, taken silently."""
    with pytest.raises(ValueError) as e:
        parse_share(text)
    assert f"{text!r} has no %" in str(e.value) and e.value.hint == f"did you mean {meant}?"


def test_exact_memory_reads_back_as_the_same_value_even_below_1mi():
    """What `export` writes must apply again: bytes below 1Mi need a unit now."""
    for v in (0, 5, 1000, 1001, 1536, 65536, MiB - 1, MiB, 2505048064, 4 * GiB):
        assert parse_memory(format_memory_exact(v)) == v, v
    assert [format_memory_exact(v) for v in (1000, 1001, 5, 4 * GiB, 2505048064)] == \
        ["1k", "1.001k", "0.005k", "4Gi", "2505048064"]


def test_formatting_is_exact_when_short_and_round_trips():
    assert [format_memory(v) for v in (4 * GiB, 1536 * MiB, 512 * MiB, 1000, UNLIMITED, 0)] == \
        ["4Gi", "1.5Gi", "512Mi", "1000", "max", "0"]
    for text in ("4Gi", "1.5Gi", "512Mi", "max", "24Gi"):
        assert format_memory(parse_memory(text)) == text
    assert [format_share(v) for v in (5000, 1250, 10000, None)] == ["50%", "12.5%", "100%", "-"]
    assert [format_duration_ns(v) for v in (0, 350_000_000, 12_300_000_000, 245_000_000_000)] == \
        ["0s", "350ms", "12.3s", "4m05s"]
