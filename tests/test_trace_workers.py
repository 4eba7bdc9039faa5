"""Hashing on several threads (hf_unlearn.trace.workers) gives the bits hashing one tensor after another gives: the
per-step exact checksums and the SHA-256 state hashes are what recordings and replays compare, whatever their
thread counts."""

from __future__ import annotations

import torch

from hf_unlearn.trace import checksums, hashing, workers


def _tensors():
    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate([3, 1 << 20, 70_000, 1 << 19, 0, 5])]
    named.append(("half", torch.randn(1 << 18, generator=g).to(torch.bfloat16)))
    named.append(("ints", torch.arange(1 << 18)))
    return named


def test_threaded_hashing_gives_the_sequential_bits(monkeypatch):
    named = _tensors()
    monkeypatch.setattr(workers, "threads", lambda: 1)
    one_sums, one_hashes = checksums.tensor_checksums(named), hashing.tensor_hashes(dict(named))
    monkeypatch.setattr(workers, "threads", lambda: 3)
    monkeypatch.setattr(workers, "MIN_BYTES", 0)
    assert checksums.tensor_checksums(named) == one_sums
    assert hashing.tensor_hashes(dict(named)) == one_hashes
    assert one_hashes == {n: hashing.tensor_hash(n, t) for n, t in named}
    assert len(set(one_sums.values())) == len(named)  # every tensor's own sum (the empty one is 0)


def test_threads_keep_the_order_and_run_every_item():
    seen = []
    out = workers.map_tensors(lambda x: seen.append(x) or x * 2, list(range(20)), [1 << 20] * 20, workers=4)
    assert out == [x * 2 for x in range(20)] and sorted(seen) == list(range(20))


def test_an_edit_of_one_element_changes_the_threaded_checksum(monkeypatch):
    monkeypatch.setattr(workers, "threads", lambda: 2)
    monkeypatch.setattr(workers, "MIN_BYTES", 0)
    named = _tensors()
    before = checksums.tensor_checksums(named)
    named[1][1].data[12345] += 1e-7
    after = checksums.tensor_checksums(named)
    assert [n for n in before if before[n] != after[n]] == ["t1"]


def test_a_forked_child_hashes_on_threads_of_its_own(monkeypatch):
    """A DataLoader worker is forked from a process whose pool threads it does not inherit: it must not wait on them."""
    import multiprocessing

    monkeypatch.setattr(workers, "MIN_BYTES", 0)
    workers.map_tensors(len, [[1], [2, 3]], [1, 1], workers=2)  # the parent's pool exists
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_child_hash).get(timeout=60) == [1, 2]


def _child_hash():
    return workers.map_tensors(len, [[1], [2, 3]], [1 << 23, 1 << 23], workers=2)


def test_the_checksum_is_xxh3_of_the_raw_bytes_whatever_the_dtype_and_layout():
    import xxhash

    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, generator=g)
    cases = {"f32": base, "bf16": base.to(torch.bfloat16), "f16": base.half(), "i64": torch.arange(7),
             "bool": base > 0, "scalar": torch.tensor(3.5), "strided": base.t(), "offset": base[2:],
             "grad": torch.randn(4, requires_grad=True), "empty": torch.zeros(0)}
    sums = checksums.tensor_checksums(list(cases.items()))
    for name, t in cases.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        assert sums[name] == (xxhash.xxh3_64_intdigest(raw) if t.numel() else 0), name
