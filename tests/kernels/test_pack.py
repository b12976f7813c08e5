"""kernels.pack_triton vs its torch twin kernels.pack_ref, over a grid of (R, M, D) and fp32 / int8.

Backends:
    interp: the Triton kernels on CPU tensors under the Triton interpreter (always runs).
    cuda:   the compiled kernels through the `kernels.pack` dispatch (only where CUDA is available).

How the interpreter is enabled: the interp outputs are computed in ONE subprocess, `python -m
tests.kernels.test_pack OUT`, started with TRITON_INTERPRET=1 in its environment; the tests here compare what it
saved. Setting the variable inside this pytest process is not robust, because Triton fixes the mode of its
own library per process: `tl.max` and the other `triton.language.standard` helpers are @triton.jit
functions decorated when `triton.language` is first imported (test_ops / test_model_equivalence import it
via transformers), an interpreted kernel calling a compiled `tl.max` fails with "Cannot call @triton.jit'd
outside of the scope of a kernel", and the variable must stay set at launch time, where it would leak into
every other Triton user in the process.

Tolerances: fp32 pack/unpack exactly equal; int8 values within one step (|q - q_ref| <= 1), scales within
1e-6 relative, dequantised rows within one step (|x - x_ref| <= scale); omitted rows exactly zero.
In practice the int8 path is bit-exact (IEEE division and round-half-even; see pack_triton's docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import pack, pack_ref

# (R, M, D): M retained rows out of R rows of length D. D=1000 gives BLOCK_D=1024 and 64 rows per program,
# so M=100 runs two programs with a masked tail even under the interpreter's large tiles.
SHAPES = [(64, 17, 32), (64, 17, 48), (40, 40, 100), (5, 1, 7), (200, 100, 1000), (8, 0, 32)]
QUANTS = {"fp32": False, "int8": True}
CASES = {f"R{r}-M{m}-D{d}-{q}": (r, m, d, q) for r, m, d in SHAPES for q in QUANTS}
TIE_ROW = [127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -126.5, 3.49, 0.0]  # absmax 127 -> scale exactly 1.0
TIE_Q = [127, 0, 2, 2, -2, 0, 126, -126, 3, 0]  # round half to even


def _inputs(R: int, M: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """src [R, D] with row magnitudes over six decades and one all-zero row; rows [M] unique, unsorted."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(R, D, generator=g) * torch.logspace(-3, 3, R)[torch.randperm(R, generator=g)][:, None]
    src[R // 2] = 0.0
    return src, torch.randperm(R, generator=g)[:M]


def _tie_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows: zeros, TIE_ROW, -TIE_ROW; retained in the order 1, 0, 2."""
    return torch.tensor([[0.0] * len(TIE_ROW), TIE_ROW, [-x for x in TIE_ROW]]), torch.tensor([1, 0, 2])


def _run(pack_rows, unpack_rows, device: str) -> dict[str, tuple]:
    """Every case through one backend, results on CPU: pack-<id> -> (values, scales), unpack-<id> -> dst."""
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = {}
    for case_id, (R, M, D, quant) in CASES.items():
        src, rows = _inputs(R, M, D, seed=0)
        out[f"pack-{case_id}"] = tuple(map(cpu, pack_rows(dev(src), dev(rows), QUANTS[quant])))
        src, rows = _inputs(R, M, D, seed=1)
        values, scales = pack_ref.pack_rows(src, rows, QUANTS[quant])
        out[f"unpack-{case_id}"] = cpu(unpack_rows(dev(values), dev(scales), dev(rows), R))
    src, rows = _tie_inputs()
    q, s = pack_rows(dev(src), dev(rows), True)
    out["ties"] = (cpu(q), cpu(s), cpu(unpack_rows(q, s, dev(rows), 4)))
    return out


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory) -> dict[str, tuple]:
    path = tmp_path_factory.mktemp("pack_triton") / "interp.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_pack", str(path)],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"interpreter subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(path)


@pytest.fixture(params=["interp", "cuda"])
def results(request) -> dict[str, tuple]:
    if request.param == "interp":
        return request.getfixturevalue("interp_results")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return _run(pack.pack_rows, pack.unpack_rows, "cuda")


@pytest.mark.parametrize("case_id", CASES)
def test_pack_rows(results, case_id):
    R, M, D, quant = CASES[case_id]
    values, scales = results[f"pack-{case_id}"]
    values_ref, scales_ref = pack_ref.pack_rows(*_inputs(R, M, D, seed=0), QUANTS[quant])
    assert values.shape == values_ref.shape and values.dtype == values_ref.dtype
    if not QUANTS[quant]:
        assert scales is None and torch.equal(values, values_ref)
        return
    step = (values.int() - values_ref.int()).abs().max().item() if M else 0
    assert step <= 1, f"int8 values differ by {step} steps"
    assert scales.dtype == torch.float32
    torch.testing.assert_close(scales, scales_ref, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("case_id", CASES)
def test_unpack_rows(results, case_id):
    R, M, D, quant = CASES[case_id]
    src, rows = _inputs(R, M, D, seed=1)
    values, scales = pack_ref.pack_rows(src, rows, QUANTS[quant])
    dst, dst_ref = results[f"unpack-{case_id}"], pack_ref.unpack_rows(values, scales, rows, R)
    assert dst.dtype == torch.float32 and dst.shape == (R, D)
    omitted = torch.ones(R, dtype=torch.bool)
    omitted[rows] = False
    assert not dst[omitted].any(), "omitted rows not zero-filled"
    if scales is None:
        assert torch.equal(dst, dst_ref)
    else:
        err = (dst[rows] - dst_ref[rows]).abs().amax(dim=-1) if M else torch.zeros(0)
        assert (err <= scales).all(), f"dequantised rows off by more than one step: {err.max().item()}"


def test_int8_ties_and_zero_row(results):
    """Halves round to even as in torch.round; the all-zero row packs to q = 0 with scale 1e-8 / 127."""
    q, s, dst = results["ties"]
    src, rows = _tie_inputs()
    q_ref, s_ref = pack_ref.pack_rows(src, rows, True)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    expected = torch.tensor(TIE_Q, dtype=torch.int8)
    assert torch.equal(q[0], expected) and not q[1].any() and torch.equal(q[2], -expected)
    assert torch.equal(dst, pack_ref.unpack_rows(q_ref, s_ref, rows, 4))


if __name__ == "__main__":  # the interp backend: python -m tests.kernels.test_pack OUT, with TRITON_INTERPRET=1
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before triton is imported"
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import pack_triton

    assert isinstance(pack_triton._pack_rows_kernel, InterpretedFunction), "TRITON_INTERPRET not honoured"
    torch.save(_run(pack_triton.pack_rows, pack_triton.unpack_rows, "cpu"), sys.argv[1])
