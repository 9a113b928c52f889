"""The compiled block map against its pure-Python twin, and against a plain model."""

from __future__ import annotations

import random
import shutil
import sysconfig

import pytest

from kvflow.router import _blockmap_py
from kvflow.router import index as index_mod

compiled = pytest.importorskip("kvflow.router._blockmap", reason="kvflow.router._blockmap was not built")


def test_the_compiled_map_is_built_where_a_compiler_exists():
    """The extension is optional at install; a silent build failure would cost the router its speed."""
    if not shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"):
        pytest.skip("no C compiler on this machine")
    assert index_mod.COMPILED
    assert index_mod.BlockMap is compiled.BlockMap


@pytest.mark.parametrize("seed", range(6))
def test_same_results_as_the_python_twin_and_a_set_model(seed):
    rng = random.Random(seed)
    c, p = compiled.BlockMap(), _blockmap_py.BlockMap()
    model: list[set[int]] = [set() for _ in range(64)]
    universe = [rng.randrange(2**64) for _ in range(rng.choice([8, 300, 3000]))] + [0, 2**64 - 1]
    names: list = [f"w{b}" for b in range(64)]
    names[5] = None
    stored_runs: list[list[int]] = [[]]
    for step in range(600):
        bit = rng.randrange(64) if rng.random() < 0.2 else rng.randrange(6)
        hs = rng.sample(universe, rng.randrange(0, min(len(universe), 300)))
        r = rng.random()
        if r < 0.45:
            n = c.store(bit, hs)
            assert n == p.store(bit, hs) == len(set(hs) - model[bit])
            model[bit].update(hs)
            stored_runs.append(hs)
        elif r < 0.85:
            n = c.remove(bit, hs)
            assert n == p.remove(bit, hs) == len(set(hs) & model[bit])
            model[bit].difference_update(hs)
        elif r < 0.88:
            assert c.clear(bit) == p.clear(bit) == len(model[bit])
            model[bit].clear()
        else:
            # a stored run (long shared matches) or random hashes (short ones)
            chain = (rng.choice(stored_runs)[: rng.randrange(1, 40)] + rng.sample(universe, 2) if rng.random() < 0.7
                     else rng.sample(universe, rng.randrange(0, min(len(universe), 12))))
            got_c: dict = {}
            got_p: dict = {}
            c.match(chain, names, got_c)
            p.match(chain, names, got_p)
            want = {}
            for b in range(64):
                run = 0
                for h in chain:
                    if h not in model[b]:
                        break
                    run += 1
                if run and names[b] is not None:
                    want[names[b]] = run
            assert got_c == got_p == want
        assert len(c) == len(p) == len(set().union(*model))
        if step % 100 == 0:
            for b in range(64):
                assert c.count(b) == p.count(b) == len(model[b])
                assert set(c.hashes(b)) == set(p.hashes(b)) == model[b]
            for h in universe[:50]:
                assert c.get(h) == p.get(h) == sum(1 << b for b in range(64) if h in model[b])


def test_grows_and_shrinks_without_losing_entries():
    m = compiled.BlockMap()
    hashes = list(range(0, 400_000, 2))  # regular keys: the multiplicative hash must still spread them
    m.store(0, hashes)
    m.store(1, hashes[::3])
    assert len(m) == len(hashes) and m.count(0) == len(hashes)
    big = m.__sizeof__()
    assert m.remove(0, hashes[1000:]) == len(hashes) - 1000
    assert m.clear(1) == len(hashes[::3])
    assert len(m) == 1000 and sorted(m.hashes(0)) == hashes[:1000]
    assert m.__sizeof__() < big / 16  # a drained map gives its memory back
    out: dict = {}
    m.match(hashes[:5], ["a", "b"], out)
    assert out == {"a": 5}


@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_bad_arguments_raise_and_change_nothing(impl):
    m = compiled.BlockMap() if impl == "compiled" else _blockmap_py.BlockMap()
    m.store(0, [1, 2, 3])
    for bad in (-1, 2**64, "7", 1.5, None):
        with pytest.raises(ValueError):
            m.store(0, [4, bad])
        with pytest.raises(ValueError):
            m.remove(0, [1, bad])
    for bit in (-1, 64):
        with pytest.raises(ValueError):
            m.store(bit, [1])
    assert sorted(m.hashes(0)) == [1, 2, 3] and m.count(0) == 3 and len(m) == 3


def u64_buffers(hashes: list[int]) -> dict:
    """The same hashes in every buffer form the maps take as native u64."""
    import struct
    from array import array

    import numpy as np

    raw = struct.pack(f"={len(hashes)}Q", *hashes)
    offset = b"\x00\x00\x00" + raw  # an unaligned view into a larger record
    return {"memoryview": memoryview(raw).cast("Q"), "unaligned_memoryview": memoryview(offset)[3:].cast("Q"),
            "array": array("Q", hashes), "numpy": np.array(hashes, dtype=np.uint64)}


@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_u64_buffers_act_as_the_same_ints(impl):
    new = compiled.BlockMap if impl == "compiled" else _blockmap_py.BlockMap
    rng = random.Random(3)
    hashes = [0, 2**64 - 1, 2**63] + [rng.randrange(2**64) for _ in range(600)]  # > one C chunk of 256
    want = new()
    want.store(0, hashes)
    want.remove(0, hashes[::5])
    names = ["a"]
    expected: dict = {}
    want.match(hashes[1:40], names, expected)
    for form, buf in u64_buffers(hashes).items():
        m = new()
        assert m.store(0, buf) == len(hashes), form
        assert m.remove(0, u64_buffers(hashes[::5])[form]) == len(hashes[::5]), form
        assert sorted(m.hashes(0)) == sorted(want.hashes(0)), form
        got: dict = {}
        m.match(u64_buffers(hashes[1:40])[form], names, got)
        assert got == expected, form
        assert m.store(1, u64_buffers([])[form]) == 0


@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_other_buffers_stay_sequences_of_ints(impl):
    from array import array

    m = compiled.BlockMap() if impl == "compiled" else _blockmap_py.BlockMap()
    assert m.store(0, b"\x01\x02") == 2  # bytes: a sequence of small ints, as before
    assert m.store(1, array("I", [5, 6])) == 2  # 32-bit items: read as ints, not as u64
    assert sorted(m.hashes(0)) == [1, 2] and sorted(m.hashes(1)) == [5, 6]
