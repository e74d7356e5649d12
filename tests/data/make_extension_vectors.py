"""Write extension_vectors.json and extension_malformed.json from the tables
of docs/extensions.md, with struct alone.

The bytes here are built by hand from the spec, not by ddpwire's encoder, so
that the tests comparing the two check the C codec against the document
rather than against itself. Run from anywhere:
    python tests/data/make_extension_vectors.py
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).parent

MAGIC = b"DDPX"
# tag bytes of the extension messages (docs/extensions.md, "Extension messages")
AUTH_CHALLENGE, AUTH_PROOF, JOIN_REFUSED = 0x40, 0x41, 0x42
COLLECTIVE_REQUEST, COLLECTIVE_RESULT, COLLECTIVE_ERROR = 0x43, 0x44, 0x45
MESH_PEERS, PEER_HELLO, STEP_REPORT, STEP_COMMIT = 0x46, 0x47, 0x48, 0x49
STEP_TIMING, SHARD_SCALE, STEP_ABORTED = 0x4A, 0x4B, 0x4C
STATE_REQUEST, MODEL_STATE = 0x4D, 0x4E
NO_WORKER = 0xFFFFFFFF
# the spec's dtype table: code -> (struct format, size)
DTYPES = {0: ("<f", 4), 1: ("<d", 8), 2: ("<e", 2), 3: ("<H", 2), 4: ("<i", 4),
          5: ("<q", 8), 6: ("<B", 1), 7: ("<?", 1)}


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def string_json(text: str) -> Dict[str, Any]:
    return {"value": text, "utf8_hex": text.encode("utf-8").hex()}


def block(entries: List[Tuple[int, bytes]], version: int = 1,
          count: Optional[int] = None) -> bytes:
    out = MAGIC + struct.pack("<BH", version, len(entries) if count is None else count)
    for etype, value in entries:
        out += struct.pack("<HI", etype, len(value)) + value
    return out


def entries_json(entries: Optional[List[Tuple[int, bytes]]]) -> Any:
    if entries is None:
        return None
    return [{"type": t, "value_hex": v.hex()} for t, v in entries]


def join_request(node_id: str, gpu_count: int, backend: str,
                 entries: Optional[List[Tuple[int, bytes]]]) -> Tuple[bytes, Dict[str, Any]]:
    payload = b"\x01" + string(node_id) + struct.pack("<I", gpu_count) + string(backend)
    if entries is not None:
        payload += block(entries)
    return payload, {"type": "JoinRequest", "tag": 1, "node_id": string_json(node_id),
                     "gpu_count": gpu_count, "backend": string_json(backend),
                     "extensions": entries_json(entries)}


def join_accepted(worker_id: int, total: int,
                  entries: Optional[List[Tuple[int, bytes]]]) -> Tuple[bytes, Dict[str, Any]]:
    payload = b"\x02" + struct.pack("<II", worker_id, total)
    if entries is not None:
        payload += block(entries)
    return payload, {"type": "JoinAccepted", "tag": 2, "worker_id": worker_id,
                     "total_workers": total, "extensions": entries_json(entries)}


def elements(dtype: int, values: List[Any]) -> bytes:
    fmt, _ = DTYPES[dtype]
    return b"".join(struct.pack(fmt, v) for v in values)


def collective_request(seq: int, kind: int, op: int, dtype: int, root: int,
                       values: List[Any]) -> Tuple[bytes, Dict[str, Any]]:
    data = elements(dtype, values)
    payload = struct.pack("<BQBBBIQQ", COLLECTIVE_REQUEST, seq, kind, op, dtype, root,
                          len(values), len(data)) + data
    return payload, {"type": "CollectiveRequest", "tag": COLLECTIVE_REQUEST, "seq": seq,
                     "kind": kind, "op": op, "dtype": dtype, "root": root,
                     "count": len(values), "data_hex": data.hex()}


def collective_result(seq: int, kind: int, dtype: int,
                      values: List[Any]) -> Tuple[bytes, Dict[str, Any]]:
    data = elements(dtype, values)
    payload = struct.pack("<BQBBQQ", COLLECTIVE_RESULT, seq, kind, dtype, len(values),
                          len(data)) + data
    return payload, {"type": "CollectiveResult", "tag": COLLECTIVE_RESULT, "seq": seq,
                     "kind": kind, "dtype": dtype, "count": len(values),
                     "data_hex": data.hex()}


NONCE_W = bytes(range(32))
NONCE_C = bytes(range(0x80, 0xA0))
# X25519 public keys as the seal entry (0x000A) carries them: 32 bytes each
SHARE_W = bytes(range(0x40, 0x60))
SHARE_C = bytes(range(0xC0, 0xE0))
PROOF = bytes(range(0xE0, 0x100))
SAMPLES_64 = struct.pack("<Q", 64)
COLLECTIVES_V1 = struct.pack("<H", 1)


def vectors() -> List[Dict[str, Any]]:
    shapes = [
        ("join_request_no_block", "reference bytes: no block",
         join_request("w0", 1, "cpu", None)),
        ("join_request_empty_block", "a block with no entries",
         join_request("w0", 1, "cpu", [])),
        ("join_request_auth", "one entry: the worker's nonce",
         join_request("w0", 1, "cpu", [(0x0001, NONCE_W)])),
        ("join_request_several_with_unknown",
         "auth, samples, collectives and an unknown type 0x7fff, kept in wire order",
         join_request("n\u0153ud-1", 2, "cuda", [(0x0002, SAMPLES_64), (0x0001, NONCE_W),
                                                 (0x7FFF, b"\x01\x02\x03"),
                                                 (0x0003, COLLECTIVES_V1)])),
        ("join_request_seal", "auth then seal: the worker's nonce and its X25519 key share",
         join_request("w0", 1, "cpu", [(0x0001, NONCE_W), (0x000A, SHARE_W)])),
        ("join_accepted_no_block", "reference bytes: nothing granted",
         join_accepted(0, 2, None)),
        ("join_accepted_empty_block", "a block with no entries",
         join_accepted(1, 2, [])),
        ("join_accepted_auth", "one entry: auth granted (empty value)",
         join_accepted(1, 4, [(0x0001, b"")])),
        ("join_accepted_seal", "auth granted, then seal: the coordinator's X25519 key share",
         join_accepted(1, 2, [(0x0001, b""), (0x000A, SHARE_C)])),
        ("join_accepted_several_with_unknown", "auth, samples, collectives and unknown 0x0010",
         join_accepted(3, 4, [(0x0001, b""), (0x0002, SAMPLES_64), (0x0003, COLLECTIVES_V1),
                              (0x0010, b"ring")])),
    ]
    challenge = bytes([AUTH_CHALLENGE]) + NONCE_C + PROOF
    shapes.append(("auth_challenge", "nonce then proof", (challenge, {
        "type": "AuthChallenge", "tag": AUTH_CHALLENGE, "nonce_hex": NONCE_C.hex(),
        "proof_hex": PROOF.hex()})))
    shapes.append(("auth_proof", "proof", (bytes([AUTH_PROOF]) + PROOF, {
        "type": "AuthProof", "tag": AUTH_PROOF, "proof_hex": PROOF.hex()})))
    for reason, detail in ((1, "all 2 slots are taken"), (4, "authentication failed \u2717")):
        shapes.append((f"join_refused_{reason}", f"reason {reason}", (
            struct.pack("<BB", JOIN_REFUSED, reason) + string(detail),
            {"type": "JoinRefused", "tag": JOIN_REFUSED, "reason": reason,
             "detail": string_json(detail)})))
    shapes += [
        ("collective_request_allreduce_f32", "allreduce sum of three float32",
         collective_request(5, 1, 0, 0, 0, [1.0, -2.5, 0.125])),
        ("collective_request_broadcast_i64", "broadcast from root 1 of two int64",
         collective_request(6, 2, 0, 5, 1, [-1, 2**40])),
        ("collective_request_barrier", "barrier: no data",
         collective_request(7, 5, 0, 6, 0, [])),
        ("collective_result_bf16", "allgather result of two bfloat16 words",
         collective_result(5, 3, 3, [0x3F80, 0xC000])),
        ("collective_result_bool", "three bools",
         collective_result(9, 1, 7, [True, False, True])),
    ]
    for worker, detail in ((2, "worker 2 sent float64, others float32"), (0xFFFFFFFF, "")):
        shapes.append((f"collective_error_{worker:x}", "seq, worker_id, detail", (
            struct.pack("<BQI", COLLECTIVE_ERROR, 11, worker) + string(detail),
            {"type": "CollectiveError", "tag": COLLECTIVE_ERROR, "seq": 11,
             "worker_id": worker, "detail": string_json(detail)})))
    key = bytes(range(0x40, 0x60))
    # 13107 (0x3333, a fifth of the vector) reads the same in either byte
    # order, so 0xFF00 is there to catch a swapped or one-byte share.
    for codec, shm, share, peers in ((0, 0, 0, "10.0.0.2:41000,10.0.0.3:41001"),
                                     (1, 0, 0, "[fe80::1]:5000,h\u00f6st:1"), (2, 0, 0, ""),
                                     (0, 1, 0, "127.0.0.1:41000,127.0.0.1:41001"),
                                     (0, 0, 13107, "10.0.0.2:41000,10.0.0.3:41001"),
                                     (2, 0, 0xFF00, "10.0.0.2:41000"),
                                     (3, 0, 0, "10.0.0.2:41000,10.0.0.3:41001")):
        name = (f"mesh_peers_codec{codec}" + ("_shm" if shm else "")
                + (f"_share{share}" if share else ""))
        shapes.append((name, "key, codec, shared_memory, coordinator_share, peers", (
            bytes([MESH_PEERS]) + key + bytes([codec, shm]) + struct.pack("<H", share)
            + string(peers),
            {"type": "MeshPeers", "tag": MESH_PEERS, "key_hex": key.hex(), "codec": codec,
             "shared_memory": shm, "coordinator_share": share, "peers": string_json(peers)})))
    shapes.append(("peer_hello", "worker_id, proof", (
        struct.pack("<BI", PEER_HELLO, 3) + PROOF,
        {"type": "PeerHello", "tag": PEER_HELLO, "worker_id": 3, "proof_hex": PROOF.hex()})))
    for bad, index, value in ((NO_WORKER, 0, 0.0), (1, 2**33 + 5, -2.5)):
        shapes.append((f"step_report_{bad:x}", "step .. total, then the first bad element", (
            struct.pack("<BQIQfQQIQf", STEP_REPORT, 7, 2, 1000, 0.75, 30, 64, bad, index, value),
            {"type": "StepReport", "tag": STEP_REPORT, "step": 7, "worker_id": 2, "count": 1000,
             "loss": 0.75, "correct": 30, "total": 64, "bad_worker": bad, "bad_index": index,
             "bad_value": value})))
        shapes.append((f"step_commit_{bad:x}", "step, global_loss, the first bad element", (
            struct.pack("<BQfIQf", STEP_COMMIT, 7, 0.5, bad, index, value),
            {"type": "StepCommit", "tag": STEP_COMMIT, "step": 7, "global_loss": 0.5,
             "bad_worker": bad, "bad_index": index, "bad_value": value})))
    for step, compute_us in ((7, 12_345), (2**40 + 3, 2**64 - 1)):
        shapes.append((f"step_timing_{compute_us:x}", "step, compute_us", (
            struct.pack("<BQQ", STEP_TIMING, step, compute_us),
            {"type": "StepTiming", "tag": STEP_TIMING, "step": step, "compute_us": compute_us})))
    # 1.0 (equal shards), 0.0 (an empty shard) and a value whose bytes differ
    for label, scale in (("one", 1.0), ("zero", 0.0), ("0_375", 0.375)):
        shapes.append((f"shard_scale_{label}", "step, scale", (
            struct.pack("<BQf", SHARD_SCALE, 9, scale),
            {"type": "ShardScale", "tag": SHARD_SCALE, "step": 9, "scale": scale})))
    # another worker lost, and the largest ids (0xFFFFFFFF is no worker elsewhere, here an id)
    for step, worker, left in ((20, 1, 2), (2**63 + 5, 0xFFFFFFFF, 0x12345678)):
        shapes.append((f"step_aborted_{worker:x}", "step, worker_id, workers", (
            struct.pack("<BQII", STEP_ABORTED, step, worker, left),
            {"type": "StepAborted", "tag": STEP_ABORTED, "step": step, "worker_id": worker,
             "workers": left})))
    shapes.append(("state_request", "step", (
        struct.pack("<BQ", STATE_REQUEST, 31),
        {"type": "StateRequest", "tag": STATE_REQUEST, "step": 31})))
    for label, data in (("empty", b""), ("bytes", bytes(range(7)) * 3)):
        digest = hashlib.sha256(data).digest()
        shapes.append((f"model_state_{label}", "step, digest, data", (
            struct.pack("<BQQ", MODEL_STATE, 30, len(data) + 5) + digest +
            struct.pack("<Q", len(data)) + data,
            {"type": "ModelState", "tag": MODEL_STATE, "step": 30, "total": len(data) + 5,
             "digest_hex": digest.hex(), "data_hex": data.hex()})))
    out = []
    for name, note, (payload, message) in shapes:
        out.append({"name": name, "note": note, "message": message,
                    "payload_len": len(payload), "frame_hex": frame(payload).hex()})
    return out


def malformed() -> List[Dict[str, Any]]:
    base_req = b"\x01" + string("w0") + struct.pack("<I", 1) + string("cpu")
    base_acc = b"\x02" + struct.pack("<II", 0, 2)
    nonce_entry = [(1, NONCE_W)]
    cases: List[Tuple[str, str, bytes, str]] = [
        ("trailing_not_magic", "bytes after backend that are not a block", base_req + b"DDPY",
         r"^4 bytes after the last field of JoinRequest$"),
        ("short_trailing_magic_prefix", "three bytes of the magic only", base_acc + b"DDP",
         r"^3 bytes after the last field of JoinAccepted$"),
        ("block_cut_in_header", "magic and version, no count", base_req + MAGIC + b"\x01",
         r"^truncated JoinRequest\.extensions count: 0 of 2 bytes$"),
        ("wrong_version", "version 2", base_req + block(nonce_entry, version=2),
         r"^invalid JoinRequest\.extensions version: 2 \(this peer reads version 1\)$"),
        ("count_too_large", "65 entries announced",
         base_acc + block([(i, b"") for i in range(65)]),
         r"^invalid JoinAccepted\.extensions count: 65 \(at most 64 entries\)$"),
        ("count_past_entries", "2 entries announced, 1 present",
         base_req + block(nonce_entry, count=2),
         r"^truncated JoinRequest\.extensions entry type: 0 of 2 bytes$"),
        ("entry_runs_past_payload", "entry length 40, 32 bytes left",
         base_req + MAGIC + struct.pack("<BHHI", 1, 1, 1, 40) + NONCE_W,
         r"^truncated JoinRequest\.extensions entry value: 32 of 40 bytes$"),
        ("duplicate_type", "type 2 twice",
         base_acc + block([(2, SAMPLES_64), (1, b""), (2, SAMPLES_64)]),
         r"^invalid JoinAccepted\.extensions entry type: 2 \(repeated in the block\)$"),
        ("block_over_4096", "one 4,090-byte entry: a 4,103-byte block",
         base_req + block([(0x7000, bytes(4090))]),
         r"^invalid JoinRequest\.extensions: 4103 \(bytes in the block, at most 4096\)$"),
        ("bytes_after_last_entry", "3 bytes after the only entry",
         base_req + block(nonce_entry) + b"\x00\x00\x00",
         r"^3 bytes after the last field of JoinRequest\.extensions$"),
        ("data_len_not_count_times_size", "count 3 float32, 8 data bytes",
         struct.pack("<BQBBBIQQ", COLLECTIVE_REQUEST, 1, 1, 0, 0, 0, 3, 8) + bytes(8),
         r"^CollectiveRequest\.data length mismatch: 8 bytes, count x dtype size is 12$"),
        ("result_data_len_not_count_times_size", "count 2 int64, 17 data bytes",
         struct.pack("<BQBBQQ", COLLECTIVE_RESULT, 1, 1, 5, 2, 17) + bytes(17),
         r"^CollectiveResult\.data length mismatch: 17 bytes, count x dtype size is 16$"),
        ("unknown_dtype", "dtype 9 (8 int8 is the last code)",
         struct.pack("<BQBBBIQQ", COLLECTIVE_REQUEST, 1, 1, 0, 9, 0, 1, 1) + bytes(1),
         r"^invalid CollectiveRequest\.dtype: 9 \(unknown dtype code\)$"),
        ("count_overflows", "2^62 float64: the byte length overflows",
         struct.pack("<BQBBQQ", COLLECTIVE_RESULT, 1, 1, 1, 2**62, 0),
         r"^invalid CollectiveResult\.count: 4611686018427387904 \(elements whose byte "
         r"length overflows 64 bits\)$"),
        ("data_past_payload", "4 float32 announced, 8 bytes present",
         struct.pack("<BQBBBIQQ", COLLECTIVE_REQUEST, 1, 1, 0, 0, 0, 4, 16) + bytes(8),
         r"^truncated CollectiveRequest\.data: 8 of 16 bytes$"),
        ("data_trailing", "one float32 and 2 bytes more",
         struct.pack("<BQBBQQ", COLLECTIVE_RESULT, 1, 1, 0, 1, 4) + bytes(6),
         r"^2 bytes after the last field of CollectiveResult$"),
        ("mesh_peers_unknown_codec", "codec 4",
         bytes([MESH_PEERS]) + bytes(32) + b"\x04\x00\x00\x00" + string(""),
         r"^invalid MeshPeers\.codec: 4 \(unknown codec\)$"),
        ("mesh_peers_shared_memory_2", "shared_memory 2",
         bytes([MESH_PEERS]) + bytes(32) + b"\x00\x02\x00\x00" + string(""),
         r"^invalid MeshPeers\.shared_memory: 2 \(not 0 or 1\)$"),
        ("mesh_peers_short_share", "one byte of coordinator_share",
         bytes([MESH_PEERS]) + bytes(32) + b"\x00\x00\x33",
         r"^truncated MeshPeers\.coordinator_share: 1 of 2 bytes$"),
        ("mesh_peers_short_key", "16 key bytes", bytes([MESH_PEERS]) + bytes(16),
         r"^truncated MeshPeers\.key: 16 of 32 bytes$"),
        ("peer_hello_trailing", "PeerHello with a byte more",
         struct.pack("<BI", PEER_HELLO, 0) + PROOF + b"\x00",
         r"^1 bytes after the last field of PeerHello$"),
        ("step_report_cut", "StepReport without bad_value",
         struct.pack("<BQIQfQQIQ", STEP_REPORT, 1, 0, 4, 0.0, 0, 0, NO_WORKER, 0),
         r"^truncated StepReport\.bad_value: 0 of 4 bytes$"),
        ("step_commit_trailing", "StepCommit with 2 bytes more",
         struct.pack("<BQfIQf", STEP_COMMIT, 1, 0.0, NO_WORKER, 0, 0.0) + b"\x00\x00",
         r"^2 bytes after the last field of StepCommit$"),
        ("step_timing_cut", "StepTiming with 4 bytes of compute_us",
         struct.pack("<BQI", STEP_TIMING, 1, 0),
         r"^truncated StepTiming\.compute_us: 4 of 8 bytes$"),
        ("step_timing_trailing", "StepTiming with a byte more",
         struct.pack("<BQQ", STEP_TIMING, 1, 0) + b"\x00",
         r"^1 bytes after the last field of StepTiming$"),
        ("shard_scale_cut", "ShardScale without its scale",
         struct.pack("<BQ", SHARD_SCALE, 1),
         r"^truncated ShardScale\.scale: 0 of 4 bytes$"),
        ("shard_scale_trailing", "ShardScale with 3 bytes more",
         struct.pack("<BQf", SHARD_SCALE, 1, 1.0) + bytes(3),
         r"^3 bytes after the last field of ShardScale$"),
        ("shard_scale_nan", "scale a quiet NaN",
         struct.pack("<BQI", SHARD_SCALE, 1, 0x7FC00000),
         r"^invalid ShardScale\.scale: nan \(not finite\)$"),
        ("shard_scale_inf", "scale +inf",
         struct.pack("<BQI", SHARD_SCALE, 1, 0x7F800000),
         r"^invalid ShardScale\.scale: inf \(not finite\)$"),
        ("shard_scale_negative", "scale -0.5",
         struct.pack("<BQf", SHARD_SCALE, 1, -0.5),
         r"^invalid ShardScale\.scale: -0\.5 \(negative\)$"),
        ("truncated_nonce", "AuthChallenge with 31 nonce bytes",
         bytes([AUTH_CHALLENGE]) + NONCE_C[:31],
         r"^truncated AuthChallenge\.nonce: 31 of 32 bytes$"),
        ("truncated_challenge_proof", "AuthChallenge with 10 proof bytes",
         bytes([AUTH_CHALLENGE]) + NONCE_C + PROOF[:10],
         r"^truncated AuthChallenge\.proof: 10 of 32 bytes$"),
        ("truncated_proof", "AuthProof with 20 bytes", bytes([AUTH_PROOF]) + PROOF[:20],
         r"^truncated AuthProof\.proof: 20 of 32 bytes$"),
        ("proof_trailing", "AuthProof with 33 bytes", bytes([AUTH_PROOF]) + PROOF + b"\x00",
         r"^1 bytes after the last field of AuthProof$"),
        ("refused_invalid_utf8", "JoinRefused detail with a lone continuation byte",
         struct.pack("<BBI", JOIN_REFUSED, 1, 3) + b"ab\x80",
         r"^invalid UTF-8 in JoinRefused\.detail at byte 2 of 3$"),
        ("collective_error_invalid_utf8", "CollectiveError detail with an overlong slash",
         struct.pack("<BQII", COLLECTIVE_ERROR, 1, 0, 2) + b"\xc0\xaf",
         r"^invalid UTF-8 in CollectiveError\.detail at byte 0 of 2$"),
        ("refused_detail_cut", "JoinRefused detail length 10, 2 bytes present",
         struct.pack("<BBI", JOIN_REFUSED, 1, 10) + b"ab",
         r"^truncated JoinRefused\.detail: 2 of 10 bytes$"),
        ("collective_error_cut", "CollectiveError without its worker_id",
         struct.pack("<BQ", COLLECTIVE_ERROR, 1),
         r"^truncated CollectiveError\.worker_id: 0 of 4 bytes$"),
        ("step_aborted_cut", "StepAborted with 2 bytes of its workers",
         struct.pack("<BQIH", STEP_ABORTED, 1, 0, 7),
         r"^truncated StepAborted\.workers: 2 of 4 bytes$"),
        ("step_aborted_trailing", "StepAborted with a byte more",
         struct.pack("<BQII", STEP_ABORTED, 1, 0, 2) + b"\x00",
         r"^1 bytes after the last field of StepAborted$"),
        ("state_request_trailing", "StateRequest with a byte more",
         struct.pack("<BQ", STATE_REQUEST, 1) + b"\x00",
         r"^1 bytes after the last field of StateRequest$"),
        ("model_state_digest_cut", "ModelState with 5 bytes of its digest",
         struct.pack("<BQQ", MODEL_STATE, 1, 9) + bytes(5),
         r"^truncated ModelState\.digest: 5 of 32 bytes$"),
        ("model_state_data_cut", "ModelState whose data length says 10, 4 bytes present",
         struct.pack("<BQQ", MODEL_STATE, 1, 10) + bytes(32) + struct.pack("<Q", 10) + bytes(4),
         r"^truncated ModelState\.data: 4 of 10 bytes$"),
        ("model_state_past_total", "ModelState with a piece longer than the whole state",
         struct.pack("<BQQ", MODEL_STATE, 1, 2) + bytes(32) + struct.pack("<Q", 3) + bytes(3),
         r"^invalid ModelState\.data length: 3 \(more than the state's total\)$"),
        ("model_state_trailing", "ModelState with 2 bytes after its data",
         struct.pack("<BQQ", MODEL_STATE, 1, 1) + bytes(32) + struct.pack("<Q", 1) + bytes(3),
         r"^2 bytes after the last field of ModelState$"),
        ("unknown_tag_0x4f", "first tag after the extension messages", b"\x4f",
         r"^unknown message tag: 0x4f$"),
    ]
    return [{"name": n, "description": d, "input_hex": p.hex(), "input_len": len(p),
             "error": e} for n, d, p, e in cases]


def main() -> None:
    header = {"source": "tests/data/make_extension_vectors.py, from the tables of "
                        "docs/extensions.md (bytes written with struct, not by ddpwire)"}
    (HERE / "extension_vectors.json").write_text(
        json.dumps({**header, "vectors": vectors()}, indent=1, ensure_ascii=True) + "\n")
    (HERE / "extension_malformed.json").write_text(json.dumps(
        {**header, "layer": "payload (tag + body, no length prefix)",
         "error": "a regular expression the ProtocolError text matches",
         "cases": malformed()}, indent=1, ensure_ascii=True) + "\n")


if __name__ == "__main__":
    main()
