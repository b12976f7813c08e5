"""The disk tier's files (issue 39's groundwork): one checkpoint entry per file, a header and raw tensors,
authenticated with HMAC-SHA256 under the deployment secret and parsed by this module alone (never pickle, never
`torch.load`: a planted file can at worst be refused).

    magic b"DASCDSK1" | header length (u32) | payload length (u64) | header (JSON) | payload | tag (32 bytes)

The header names the model and codec fingerprints, a keyed digest of the cache salt (never the salt), the seed of
the salt's digest chain (`app.cache.digest.chain_seed`: what routers see in digests anyway), the tokens the state
follows, the checkpoint's kind, when it was written, and each tensor's name, dtype and shape; the payload is
the tensors' bytes end to end; the tag is the HMAC of everything before it. `read_entry` refuses a file, with the
reason, that is torn (shorter than it says), corrupted (no magic, a header that does not parse, lengths that do not
add up), unauthenticated (the tag does not match: another secret, or altered bytes), foreign (another model or codec
fingerprint) or mismatched (another salt, or tokens that do not start the prompt).

Names: `entry_path` files an entry under a directory per model and codec fingerprint (`fingerprint_dir`: a keyed
hash of both, so entries of an older model or codec are one directory to remove), then a directory named by a keyed
hash of the salt and its prefix up to its last full block, and a file named by a keyed hash of that directory's name
and the tokens after it (`entry_name`). All are HMACs under the secret, so that neither a salt nor a token sequence
can be confirmed from the names offline; a lookup computes the directories a prompt's blocks lead to and the names
its depths would have there, and reads only those files. Every directory level is made 0700 and files 0600; a file
is written to a temporary name in its directory and renamed into place (atomic on
one filesystem), so a reader sees a whole file or none.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import time
from pathlib import Path

import torch

MAGIC = b"DASCDSK1"
TAG = 32
MAX_HEADER = 64 * 2**20  # a header's bytes (its tokens, in JSON) beyond which `read_header` refuses to read it
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
NAMES = {v: k for k, v in DTYPES.items()}


class DiskEntryError(ValueError):
    """A file refused, with `reason`: torn, corrupted, unauthenticated, foreign or mismatched."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def keyed(secret: bytes, *parts) -> str:
    """32 hex digits of HMAC-SHA256 under `secret` over `parts` (each as its JSON text, NUL-separated)."""
    text = b"\x00".join(json.dumps(p, separators=(",", ":")).encode() for p in parts)
    return hmac.new(secret, text, hashlib.sha256).hexdigest()[:32]


def salt_key(secret: bytes, salt: str | None) -> str:
    """What a header keeps of the cache salt: a keyed digest, which only the secret's holder can compute."""
    return keyed(secret, "salt", salt)


def fingerprint_dir(root: Path, secret: bytes, model_fp: str, codec_fp: str) -> Path:
    """The directory of every entry of one model and codec."""
    return root / ("fp-" + keyed(secret, "fp", model_fp, codec_fp))


def entry_path(root: Path, secret: bytes, model_fp: str, codec_fp: str, salt: str | None, tokens: list[int],
               block: int) -> Path:
    """Where the entry of `tokens` is filed (see the module doc)."""
    k = len(tokens) // block * block
    folder = block_dir(root, secret, model_fp, codec_fp, salt, tokens[:k])
    return folder / entry_name(secret, folder.name, tokens[k:])


def entry_name(secret: bytes, folder: str, tail: list[int]) -> str:
    """The file name of the entry whose tokens are its directory's prefix (`folder`: that directory's name, itself
    keyed over fingerprints, salt and prefix) followed by `tail` (fewer than a block): a lookup computes the names
    of a prompt's candidate depths and reads only files that exist under one."""
    return keyed(secret, "file", folder, tail) + ".ckpt"


def block_dir(root: Path, secret: bytes, model_fp: str, codec_fp: str, salt: str | None, prefix: list[int]) -> Path:
    """The directory of the entries whose last full block ends `prefix`."""
    return fingerprint_dir(root, secret, model_fp, codec_fp) / keyed(secret, "dir", model_fp, codec_fp, salt, prefix)


def write_entry(path: Path, secret: bytes, header: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write one entry atomically (temporary file, then rename; directories 0700, the file 0600); returns its
    bytes. `header` gets the tensors' names, dtypes and shapes and the time."""
    root, *inner = path.parents[2], path.parents[1], path.parents[0]
    root.mkdir(mode=0o700, parents=True, exist_ok=True)  # the tier's directory, its fingerprint's, the entry's
    for folder in inner:
        folder.mkdir(mode=0o700, exist_ok=True)
    head = {**header, "written": time.time(),
            "tensors": [{"name": n, "dtype": NAMES[t.dtype], "shape": list(t.shape)} for n, t in tensors.items()]}
    text = json.dumps(head, separators=(",", ":")).encode()
    views = [memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()) for t in tensors.values()]
    size = sum(v.nbytes for v in views)
    parts = [MAGIC + struct.pack("<IQ", len(text), size) + text, *views]
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:  # streamed: the tensors' bytes are hashed and written without a copy
            for part in parts:
                mac.update(part)
                f.write(part)
            f.write(mac.digest())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(parts[0]) + size + TAG


def read_header(path: Path) -> dict:
    """The header of the entry at `path`, read alone and not authenticated (the tag covers the payload too): what
    the tier's index publishes as routing hints, which a lookup then checks in full. DiskEntryError if it does not
    parse; OSError if the file cannot be read."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 12)
        if len(head) < len(MAGIC) + 12 or head[: len(MAGIC)] != MAGIC:
            raise DiskEntryError("corrupted", "no magic")
        length, _ = struct.unpack("<IQ", head[len(MAGIC):])
        if length > MAX_HEADER:
            raise DiskEntryError("corrupted", f"a {length}-byte header")
        text = f.read(length)
    try:
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("not an object")
        return header
    except ValueError as e:
        raise DiskEntryError("torn" if len(text) < length else "corrupted", f"header: {e}") from None


def read_entry(path: Path, secret: bytes, model_fp: str, codec_fp: str, salt_key: str,
               prompt: list[int] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(header, tensors) of the entry at `path`, checked (see the module doc); DiskEntryError otherwise, and
    FileNotFoundError if it vanished (another replica evicted it)."""
    with open(path, "rb") as f:  # into one writable buffer, which the tensors then view without a copy
        blob = bytearray(os.fstat(f.fileno()).st_size)
        del blob[f.readinto(blob):]  # shorter if it was truncated meanwhile
    start = len(MAGIC) + 12
    if len(blob) < start + TAG:
        raise DiskEntryError("torn", f"{len(blob)} bytes")
    if blob[: len(MAGIC)] != MAGIC:
        raise DiskEntryError("corrupted", "no magic")
    length, size = struct.unpack("<IQ", blob[len(MAGIC) : start])
    if start + length + size + TAG != len(blob):
        raise DiskEntryError("torn" if start + length + size + TAG > len(blob) else "corrupted",
                             f"{len(blob)} bytes, its lengths say {start + length + size + TAG}")
    view = memoryview(blob)
    if not hmac.compare_digest(bytes(view[-TAG:]), hmac.new(secret, view[:-TAG], hashlib.sha256).digest()):
        raise DiskEntryError("unauthenticated")
    try:
        header = json.loads(blob[start : start + length])
        specs = [(s["name"], DTYPES[s["dtype"]], [int(d) for d in s["shape"]]) for s in header["tensors"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DiskEntryError("corrupted", f"header: {e}") from None
    if header.get("model") != model_fp or header.get("codec") != codec_fp:
        raise DiskEntryError("foreign")
    tokens = header.get("tokens")
    if header.get("salt") != salt_key or not isinstance(tokens, list) or (
            prompt is not None and prompt[: len(tokens)] != tokens):
        raise DiskEntryError("mismatched")
    tensors, at, end = {}, start + length, len(blob) - TAG
    for name, dtype, shape in specs:
        n = torch.Size(shape).numel() * dtype.itemsize
        if at + n > end:
            raise DiskEntryError("corrupted", "payload shorter than its tensors")
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=n, offset=at) if n else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
        at += n
    if at != end:
        raise DiskEntryError("corrupted", "payload longer than its tensors")
    return header, tensors
