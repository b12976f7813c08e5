"""The disk tier's file format (app/cache/disk_format.py): a bit-exact round trip; torn, corrupted,
unauthenticated, foreign and mismatched files refused with their reason; names that reveal neither salt nor
tokens; 0700 directories and 0600 files; atomic writes; and no pickle or torch.load anywhere on the path."""

from __future__ import annotations

import ast
import inspect
import stat

import pytest
import torch

from app.cache import disk_format as fmt
from app.cache.disk_format import DiskEntryError, entry_path, read_entry, salt_key, write_entry

SECRET, OTHER = b"deployment-secret", b"another-secret"
MODEL, CODEC = "model-fp", "codec-fp"
TOKENS = list(range(500, 700))


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"state.0": torch.randn(3, 5, generator=g),
            "state.1": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=g),
            "kv.3": torch.randn(200, 4, generator=g).to(torch.bfloat16), "empty": torch.zeros(0)}


def _write(tmp_path, secret=SECRET, salt="tenant-a", tokens=TOKENS, model=MODEL):
    path = entry_path(tmp_path, secret, model, CODEC, salt, tokens, 64)
    header = {"model": model, "codec": CODEC, "salt": salt_key(secret, salt), "tokens": tokens, "kind": "prompt_end"}
    write_entry(path, secret, header, _tensors())
    return path


def test_a_round_trip_is_bit_exact(tmp_path):
    path = _write(tmp_path)
    header, tensors = read_entry(path, SECRET, MODEL, CODEC, salt_key(SECRET, "tenant-a"), TOKENS + [1, 2])
    assert header["tokens"] == TOKENS and header["kind"] == "prompt_end"
    for name, t in _tensors().items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[: len(b) // 2], "torn"),
    (lambda b: b[:10], "torn"),
    (lambda b: b"XXXXXXXX" + b[8:], "corrupted"),
    (lambda b: b[:-40] + bytes([b[-40] ^ 1]) + b[-39:], "unauthenticated"),  # a payload bit flipped
    (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "unauthenticated"),  # a header bit flipped
])
def test_damaged_files_are_refused_with_their_reason(tmp_path, damage, reason):
    path = _write(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DiskEntryError) as e:
        read_entry(path, SECRET, MODEL, CODEC, salt_key(SECRET, "tenant-a"))
    assert e.value.reason == reason


def test_foreign_mismatched_and_planted_files_are_refused(tmp_path):
    path = _write(tmp_path)
    key = salt_key(SECRET, "tenant-a")
    for args, reason in [((SECRET, "other-model", CODEC, key), "foreign"),
                         ((SECRET, MODEL, "other-codec", key), "foreign"),
                         ((SECRET, MODEL, CODEC, salt_key(SECRET, "tenant-b")), "mismatched"),
                         ((OTHER, MODEL, CODEC, key), "unauthenticated")]:
        with pytest.raises(DiskEntryError) as e:
            read_entry(path, *args)
        assert e.value.reason == reason
    with pytest.raises(DiskEntryError) as e:  # tokens that do not start the prompt
        read_entry(path, SECRET, MODEL, CODEC, key, [9] + TOKENS)
    assert e.value.reason == "mismatched"
    planted = _write(tmp_path / "planted", secret=OTHER)  # well formed, but made without the deployment's secret
    with pytest.raises(DiskEntryError, match="unauthenticated"):
        read_entry(planted, SECRET, MODEL, CODEC, salt_key(OTHER, "tenant-a"))


def test_names_reveal_neither_salt_nor_tokens_and_depend_on_the_secret(tmp_path):
    path = _write(tmp_path)
    assert path == entry_path(tmp_path, SECRET, MODEL, CODEC, "tenant-a", TOKENS, 64)  # a lookup finds it
    names = str(path.relative_to(tmp_path))
    assert "tenant" not in names and "500" not in names and "," not in names
    assert entry_path(tmp_path, OTHER, MODEL, CODEC, "tenant-a", TOKENS, 64) != path
    assert entry_path(tmp_path, SECRET, MODEL, CODEC, "tenant-b", TOKENS, 64) != path
    # entries ending in the same block share its directory; another salt's never does
    assert entry_path(tmp_path, SECRET, MODEL, CODEC, "tenant-a", TOKENS[:195], 64).parent == path.parent
    assert entry_path(tmp_path, SECRET, MODEL, CODEC, "tenant-b", TOKENS[:195], 64).parent != path.parent


def test_permissions_are_0700_and_0600_and_writes_leave_no_temporary_files(tmp_path):
    path = _write(tmp_path / "tier")
    assert path.parents[2] == tmp_path / "tier"
    assert [stat.S_IMODE(d.stat().st_mode) for d in path.parents[:3]] == [0o700] * 3  # entry, fingerprint, tier
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_no_pickle_or_torch_load_on_the_disk_path():
    tree = ast.parse(inspect.getsource(fmt))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"pickle", "dill", "cloudpickle", "marshal", "shelve"}
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not {c for c in calls if c.endswith(("torch.load", "pickle.loads", "pickle.load", "np.load"))}
