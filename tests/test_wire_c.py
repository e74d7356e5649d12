"""The C layer on its own: csrc/wire.c builds warning-free as plain C99, and
its streaming API (head decoder, tail decoder, head and tail encoders) does
what a socket reader needs, under AddressSanitizer where the compiler has it."""
from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

import pytest

import ddpwire
from wire_cases import MALFORMED, VECTORS, f32_bits_from_f64

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PROBE_SRC = Path(__file__).parent / "c" / "head_probe.c"

# wire.h status codes
OK, NEED_MORE = 0, 1
ERR_TRUNCATED, ERR_OVERFLOW, ERR_TRAILING = -3, -5, -6
GRADIENT_TAGS = {4, 5, 8, 9, 10, 11}


def compiler() -> list:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def test_wire_c_compiles_as_strict_c99_without_warnings(tmp_path):
    for source in sorted(CSRC.glob("*.c")):
        result = subprocess.run(
            [*compiler(), "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic",
             "-c", str(source), "-o", str(tmp_path / (source.stem + ".o"))],
            capture_output=True, text=True,
        )
        assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("probe") / "head_probe"
    base = [*compiler(), "-std=c99", "-Wall", "-Wextra", "-Werror", "-g", "-I", str(CSRC),
            str(CSRC / "wire.c"), str(PROBE_SRC), "-o", str(out)]
    sanitized = subprocess.run(base + ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
                               capture_output=True, text=True)
    if sanitized.returncode != 0:  # no sanitizer runtime here: a plain build still checks results
        plain = subprocess.run(base, capture_output=True, text=True)
        assert plain.returncode == 0, plain.stderr
    return out


def run_probe(probe: Path, payload: bytes, flags: int = 0) -> list:
    result = subprocess.run([str(probe), str(flags)], input=payload, capture_output=True,
                            env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1"})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    return [line.split() for line in result.stdout.decode().splitlines()]


def parse_head(words: list) -> dict:
    assert words[0] == "head"
    n = int(words[9])
    fields = [int(w) for w in words[1:]]
    avail, tag, has_gradients, step, worker_id, block_idx, num_blocks, component, count = fields[:9]
    sizes = fields[9 : 9 + n]
    gradient_count, offset, tail_len, trailing_len = fields[9 + n :]
    return dict(avail=avail, tag=tag, has_gradients=has_gradients, step=step,
                worker_id=worker_id, block_idx=block_idx, num_blocks=num_blocks,
                component=component, component_sizes=sizes, gradient_count=gradient_count,
                offset=offset, tail_len=tail_len, trailing_len=trailing_len)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_head_decoder_on_reference_payloads(probe, vector):
    payload = bytes.fromhex(vector["frame_hex"])[4:]
    msg = ddpwire.decode_payload(payload)
    lines = run_probe(probe, payload)
    needs = [line for line in lines if line[0] == "need"]
    head = parse_head(next(line for line in lines if line[0] == "head"))
    # NEED_MORE for every shorter prefix, each asking for more than it has
    assert [int(line[1]) for line in needs] == list(range(head["avail"]))
    for _, avail, need in needs:
        assert int(avail) < int(need) <= max(head["avail"], 1)
    assert head["tag"] == msg.TAG
    if msg.TAG not in GRADIENT_TAGS:
        assert head["has_gradients"] == 0 and head["avail"] == 1
        assert len(lines) == 2
        return
    assert head["has_gradients"] == 1
    # the head is complete exactly when every byte before the elements is in
    assert head["avail"] == head["offset"]
    count = len(msg.gradients)
    assert head["gradient_count"] == count
    assert head["offset"] + 4 * count + head["tail_len"] == len(payload)
    assert head["tail_len"] == {4: 20, 5: 4}.get(msg.TAG, 0)
    assert head["trailing_len"] == 0
    assert head["step"] == msg.step
    for field in ("worker_id", "block_idx", "num_blocks", "component"):
        if field in type(msg).__slots__:
            assert head[field] == getattr(msg, field), field
    if "component_sizes" in type(msg).__slots__:
        assert head["component_sizes"] == msg.component_sizes.tolist()
    tail = next(line for line in lines if line[0] == "tail")
    if msg.TAG == 4:
        assert int(tail[1]) == f32_bits_from_f64(msg.loss)
        assert (int(tail[2]), int(tail[3])) == (msg.correct, msg.total)
    if msg.TAG == 5:
        assert int(tail[4]) == f32_bits_from_f64(msg.global_loss)
    assert ["reencode", "same"] in lines


PAYLOAD_REFUSED = [c for c in MALFORMED
                   if c["layer"] == "payload" and c["result"]["outcome"] in ("error", "panic")]


@pytest.mark.parametrize("case", PAYLOAD_REFUSED, ids=[c["name"] for c in PAYLOAD_REFUSED])
def test_head_decoder_refuses_bad_gradient_heads_early(probe, case):
    """Offered byte by byte, the head decoder reports every malformed gradient
    message as an error (never OK), reading nothing past what has arrived."""
    payload = bytes.fromhex(case["input_hex"])
    lines = run_probe(probe, payload)
    last = lines[-1]
    if payload and payload[0] in GRADIENT_TAGS:
        assert last[0] == "error", lines
        if "overflow" in case["name"] and "0x3fff" not in case["name"]:
            assert int(last[1]) == ERR_OVERFLOW
    elif payload and 1 <= payload[0] <= 11:
        assert last[0] == "head" and last[3] == "0"  # decoded whole, elsewhere
    else:
        assert last[0] == "error"


TRAILING = [c for c in MALFORMED if c["name"].startswith("trailing_bytes_")]


@pytest.mark.parametrize("case", TRAILING, ids=[c["name"] for c in TRAILING])
def test_head_decoder_trailing_bytes_flag(probe, case):
    payload = bytes.fromhex(case["input_hex"])
    if payload[0] not in GRADIENT_TAGS:
        return
    strict = run_probe(probe, payload, flags=0)
    assert strict[-1][0] == "error" and int(strict[-1][1]) == ERR_TRAILING
    lenient = run_probe(probe, payload, flags=1)
    head = parse_head(next(line for line in lenient if line[0] == "head"))
    assert head["trailing_len"] == 2
    assert head["offset"] + 4 * head["gradient_count"] + head["tail_len"] + 2 == len(payload)
    assert ["reencode", "same"] in lenient
