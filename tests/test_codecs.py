"""The codec table (ddpwire/plane/codecs.py): one description of each wire
codec, and every layer that names a codec reading it there (issue 43)."""
import numpy as np
import pytest

from ddpwire import Codec, DType, reduce
from ddpwire.plane import codecs
from ddpwire.plane.collectives import NUMPY_DTYPES


def test_every_code_on_the_wire_is_described_once():
    assert sorted(c.code for c in codecs.CODECS) == sorted(Codec)
    assert len({c.name for c in codecs.CODECS}) == len(codecs.CODECS)
    for c in codecs.CODECS:
        assert codecs.by_code(c.code) is c and codecs.codec_of(c.name) is c
        # a collective's bfloat16 or float16 are a 16-bit codec's words; its
        # uint8 may be anyone's bytes, int8's among them
        assert codecs.by_dtype(c.dtype) is (None if c.block else c)
        # a codec with blocks carries its kernels; the others run in the exchange
        assert (c.kernels is not None) == bool(c.block)
    assert codecs.by_dtype(DType.UINT8) is None
    assert codecs.codec_of(None) is codecs.FLOAT32 and codecs.FLOAT32.half is None


@pytest.mark.parametrize("codec", codecs.CODECS, ids=lambda c: str(c.name))
def test_a_codec_s_width_and_kernels_are_what_its_elements_take(codec):
    values = np.linspace(-3, 3, 64, dtype=np.float32)
    if codec.block:
        # a scale per block: n codes and 4 bytes a block, a trailing part too
        assert codec.width == 0 and codec.dtype is DType.UINT8
        for n in (0, 1, 255, 256, 257, 1000):
            assert codec.size(n) == n + 4 * -(-n // codec.block)
        coded = reduce.int8_encode(values)
        assert coded.nbytes == codec.size(values.size)
        np.testing.assert_allclose(reduce.int8_decode(coded), values, atol=3 / 127 / 2 + 1e-7)
        return
    assert np.dtype(NUMPY_DTYPES[codec.dtype]).itemsize == codec.width
    assert codec.size(10) == 10 * codec.width
    if codec.half is None:
        assert codec.width == 4
        return
    bits = reduce.to_half(values, codec=codec.half)
    assert bits.nbytes == codec.width * values.size
    np.testing.assert_allclose(reduce.from_half(bits, codec=codec.half), values, rtol=1e-2)


def test_an_unknown_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"compression must be None or one of 'bf16', 'fp16', "
                                         r"'int8', got 'int4'"):
        codecs.codec_of("int4")
    with pytest.raises(ValueError):
        codecs.codec_of(["bf16"])  # unhashable: the same refusal, not a TypeError


def test_the_command_and_the_kernels_take_the_table_s_names(capsys):
    from ddpwire.cli import build_parser

    assert reduce.CODECS == tuple(c.half for c in codecs.CODECS if c.half)
    for name in codecs.names():
        args = build_parser().parse_args(["coordinator", "--workers", "2", "--compression", name])
        assert args.compression == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator", "--workers", "2", "--compression", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert codecs.by_dtype(DType.INT64) is None
