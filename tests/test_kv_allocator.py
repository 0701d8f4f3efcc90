"""SlotAllocator: exact accounting, clear errors, and consistent iteration tables."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_ext.kv import KVCacheFullError, SlotAllocator, UnknownRequestError


def test_allocate_extend_free_counts():
    alloc = SlotAllocator(num_blocks=10, block_size=4)
    alloc.allocate(1, 5)
    assert alloc.blocks(1) == [0, 1] and alloc.capacity(1) == 8
    alloc.extend(1, 8)  # still fits in its two blocks
    assert alloc.num_free_blocks == 8
    alloc.extend(1, 9)
    assert len(alloc.blocks(1)) == 3 and alloc.num_used_blocks == 3
    alloc.allocate(2, 0)
    assert alloc.blocks(2) == [] and 2 in alloc and alloc.num_requests == 2
    alloc.free(1)
    alloc.free(2)
    assert alloc.num_free_blocks == 10 and alloc.num_requests == 0 and 1 not in alloc


def test_errors_are_clear():
    alloc = SlotAllocator(4, 2)
    alloc.allocate(7, 3)
    with pytest.raises(ValueError, match="request 7 already holds KV blocks"):
        alloc.allocate(7, 1)
    with pytest.raises(UnknownRequestError, match="request 8 holds no KV blocks"):
        alloc.free(8)
    with pytest.raises(KeyError):
        alloc.extend(8, 1)
    with pytest.raises(KVCacheFullError, match="needs 3 more blocks of 2 slots, 2 of 4 are free"):
        alloc.allocate(9, 6)
    assert alloc.num_free_blocks == 2 and 9 not in alloc  # a failed allocate takes nothing
    with pytest.raises(KVCacheFullError):
        alloc.extend(7, 9)
    assert alloc.capacity(7) == 4
    assert not alloc.can_allocate(5) and alloc.can_allocate(4)
    with pytest.raises(ValueError, match="num_blocks must be in"):
        SlotAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        SlotAllocator(4, 0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        alloc.allocate(10, -1)


def test_build_metadata():
    alloc = SlotAllocator(16, 4)
    alloc.allocate(10, 6)
    alloc.allocate(20, 9)
    cu, ctx, table, slots, positions = alloc.build_metadata([20, 10], [8, 0], [1, 6])
    assert cu.tolist() == [0, 1, 7] and ctx.tolist() == [9, 6]
    b20, b10 = alloc.blocks(20), alloc.blocks(10)
    assert table.tolist() == [b20, b10 + [0]]
    assert slots.tolist() == [b20[2] * 4] + [b10[p // 4] * 4 + p % 4 for p in range(6)]
    assert positions.tolist() == [8, 0, 1, 2, 3, 4, 5]
    assert (cu.dtype, table.dtype, slots.dtype, positions.dtype) == (
        torch.int32, torch.int32, torch.int64, torch.int64)
    with pytest.raises(ValueError, match="request 10 needs 9 KV slots but holds 8"):
        alloc.build_metadata([10], [6], [3])
    with pytest.raises(KeyError):
        alloc.build_metadata([99], [0], [1])
    with pytest.raises(ValueError, match="same length"):
        alloc.build_metadata([10], [0, 1], [1])
    empty = alloc.build_metadata([], [], [])
    assert empty[0].tolist() == [0] and empty[2].shape == (0, 1) and empty[3].numel() == 0


ops_strategy = st.lists(
    st.tuples(st.sampled_from(["allocate", "extend", "free"]), st.integers(0, 7),
              st.integers(0, 40)),
    max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 3, 16]), ops=ops_strategy)
def test_random_sequences_keep_exact_accounting(num_blocks, block_size, ops):
    alloc = SlotAllocator(num_blocks, block_size)
    model: dict[int, int] = {}  # request -> blocks it must hold

    def need(tokens: int) -> int:
        return -(-tokens // block_size)

    for op, rid, tokens in ops:
        free = num_blocks - sum(model.values())
        if op == "allocate":
            if rid in model:
                with pytest.raises(ValueError):
                    alloc.allocate(rid, tokens)
            elif need(tokens) > free:
                with pytest.raises(KVCacheFullError):
                    alloc.allocate(rid, tokens)
            else:
                alloc.allocate(rid, tokens)
                model[rid] = need(tokens)
        elif op == "extend":
            if rid not in model:
                with pytest.raises(UnknownRequestError):
                    alloc.extend(rid, tokens)
            elif need(tokens) - model[rid] > free:
                with pytest.raises(KVCacheFullError):
                    alloc.extend(rid, tokens)
            else:
                alloc.extend(rid, tokens)
                model[rid] = max(model[rid], need(tokens))
        else:
            if rid in model:
                alloc.free(rid)
                del model[rid]
            else:
                with pytest.raises(UnknownRequestError):
                    alloc.free(rid)
        # No block is owned twice, and the free count is exact.
        owned = [b for r in model for b in alloc.blocks(r)]
        assert len(owned) == len(set(owned)) == sum(model.values())
        assert all(0 <= b < num_blocks for b in owned)
        assert alloc.num_free_blocks == num_blocks - len(owned)
        for r, n in model.items():
            assert len(alloc.blocks(r)) == n
    if model:
        ids = sorted(model)
        caps = [alloc.capacity(r) for r in ids]
        computed = [c // 2 for c in caps]
        cu, ctx, table, slots, positions = alloc.build_metadata(ids, computed,
                                                                [c - d for c, d in zip(caps, computed)])
        assert ctx.tolist() == caps
        assert len(set(slots.tolist())) == slots.numel()  # every new token gets its own slot
        for r, rid in enumerate(ids):
            rows = range(cu[r].item(), cu[r + 1].item())
            blocks = alloc.blocks(rid)
            assert table[r, :len(blocks)].tolist() == blocks
            for t in rows:
                pos = positions[t].item()
                assert slots[t].item() == blocks[pos // block_size] * block_size + pos % block_size
    for r in list(model):
        alloc.free(r)
    assert alloc.num_free_blocks == num_blocks
